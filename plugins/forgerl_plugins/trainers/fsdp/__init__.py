"""``fsdp``: torch FSDP2 (``fully_shard``) on 1..N ranks; gloo on CPU, NCCL on GPU."""

from __future__ import annotations

from forgerl.backends import TrainerBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="fsdp",
            factory="forgerl_plugins.trainers.fsdp.trainer:FSDPTrainer",
            options="forgerl_plugins.trainers.fsdp.options:FSDPTrainerOptions",
            description="torch FSDP2 fully_shard, AdamW, DCP checkpoints",
            local_preflight="forgerl_plugins.trainers.shared.distributed:local_preflight",
            requires=("torch", "transformers"),
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("FSDPTrainerOptions",))
