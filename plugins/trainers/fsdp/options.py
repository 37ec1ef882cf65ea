"""Options of the backends registered in forgerl_plugins.trainers.fsdp (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
