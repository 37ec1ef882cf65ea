"""Options of the backends registered in forgerl_plugins.trainers.torchtitan (imported only when validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from forgerl_plugins.trainers.shared.options import ShardedTrainerOptions


class TorchTitanTrainerOptions(ShardedTrainerOptions):
    """The shared trainer options (the same update as ``fsdp``), plus TorchTitan's parallelism."""

    tp: int = Field(
        1, ge=1, le=1024,
        description="Tensor-parallel degree: ranks that split each layer's heads and feed-forward "
        "(must divide trainer.ranks and the model's key/value heads).",
    )
    dp_shard: int | None = Field(
        None, ge=1, le=65_536,
        description="FSDP degree: ranks the parameters are sharded over (default: trainer.ranks / tp; "
        "dp_shard * tp must equal trainer.ranks).",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute activations in the backward pass: 'full' whole decoder layers, 'selective' "
        "per op (less memory, more compute).",
    )
    compile: bool = Field(
        False, description="torch.compile each decoder layer (off by default: minutes to compile, and on CPU a C++ compiler)."
    )
