"""Options every trainer built on :class:`.base.ShardedTrainer` takes: the base of
``FSDPTrainer.Options`` and ``TorchTitanTrainer.Options``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from forgerl.adapters import LoraOptions
from forgerl.options import OptionsModel

# torch.distributed's backend names, alone or per device type ("cpu:gloo,cuda:nccl").
_NAME = "(gloo|nccl|mpi|ucc|xccl)"
DIST_BACKEND = re.compile(rf"{_NAME}|(cpu|cuda|xpu):{_NAME}(,(cpu|cuda|xpu):{_NAME})*")


class ShardedTrainerOptions(OptionsModel):
    """AdamW, gradient clipping, micro-batching, bf16 autocast and the process-group backend."""

    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate (at most 1).")
    weight_decay: float = Field(0.0, ge=0, le=1.0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None: off).")
    micro_batch_size: int | None = Field(
        None, ge=1, le=65_536,
        description="Most sequences per forward/backward on each rank (None: as many as micro_batch_tokens allows).",
    )
    # 2048: on a 2-core Xeon, 16 rows of ~116 tokens per pass trained 10-20% faster than
    # 8, and 32 no faster than 16 (docs/performance.md); memory grows with the positions.
    micro_batch_tokens: int | None = Field(
        2048, ge=1, le=16_777_216,
        description="Most positions (rows x the longest row's tokens) per forward/backward on each rank: rows "
        "of like length are grouped up to it, and a longer row runs alone (None: micro_batch_size rows each).",
    )
    # "auto" by default: where bf16 is native it halves the demo's training time, and with
    # the ratio against the trainer's own logprobs (algorithm.ratio 'auto') it learns as
    # fp32 does (held-out 0.34 -> 0.83 against 0.78 in fp32; docs/performance.md).
    autocast_bf16: bool | Literal["auto"] = Field(
        "auto",
        description="bfloat16 autocast for forward/backward (fp32 master weights); 'auto': on where the "
        "device computes bf16 natively (CPU with avx512_bf16 or AMX, CUDA compute capability 8.0+).",
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, le=1_048_576, description="Tokens per block when computing token logprobs (bounds the fp32 scratch memory)."
    )
    log_entropy: bool = Field(True, description="Report the mean token entropy (one more pass over the logits).")
    backend: str | None = Field(
        None,
        description="torch.distributed backend: gloo, nccl, mpi, ucc or per-device 'cpu:gloo,cuda:nccl' "
        "(default: nccl on GPU, gloo on CPU).",
    )
    lora: LoraOptions | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (None: full fine-tuning); "
        "e.g. --set trainer.options.lora.rank=16. Needs PEFT: pip install 'forgerl[lora]'.",
    )

    @model_validator(mode="after")
    def _some_micro_batch_limit(self) -> ShardedTrainerOptions:
        if self.micro_batch_size is None and self.micro_batch_tokens is None:
            raise ValueError(
                "micro_batch_size and micro_batch_tokens are both None: set one of them, or both, "
                "to bound the memory of one forward/backward"
            )
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {value}")
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None and not DIST_BACKEND.fullmatch(value):
            raise ValueError(
                f"unknown torch.distributed backend {value!r}: use gloo, nccl, mpi, ucc, xccl, "
                "or one per device such as 'cpu:gloo,cuda:nccl'"
            )
        return value
