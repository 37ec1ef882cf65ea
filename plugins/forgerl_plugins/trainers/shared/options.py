"""Options every trainer built on :class:`.base.ShardedTrainer` takes (imported only when validated)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

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
    micro_batch_size: int = Field(
        8, ge=1, le=65_536, description="Sequences per forward/backward on each rank."
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
