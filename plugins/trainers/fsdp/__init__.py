"""``fsdp``: torch FSDP2 (``fully_shard``) on 1..N ranks; gloo on CPU, NCCL on GPU."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import TrainerBackend
from forgerl.hookspecs import hookimpl


class FSDPTrainerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None: off).")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward on each rank.")
    autocast_bf16: bool = Field(False, description="bfloat16 autocast for forward/backward (fp32 master weights).")
    logprob_chunk_size: int = Field(
        1024, ge=1, description="Tokens per block when computing token logprobs (bounds the fp32 scratch memory)."
    )
    log_entropy: bool = Field(True, description="Report the mean token entropy (one more pass over the logits).")
    backend: str | None = Field(None, description="torch.distributed backend (default: nccl on GPU, gloo on CPU).")


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="fsdp",
            factory="forgerl_plugins.trainers.fsdp.trainer:FSDPTrainer",
            options=FSDPTrainerOptions,
            description="torch FSDP2 fully_shard, AdamW, DCP checkpoints",
            requires=("torch", "transformers"),
        )
    ]
