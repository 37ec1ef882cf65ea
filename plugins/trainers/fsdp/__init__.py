"""``fsdp``: torch FSDP2 (``fully_shard``) on 1..N ranks; gloo on CPU, NCCL on GPU."""

from __future__ import annotations

from forgerl.backends import TrainerBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="fsdp",
            factory="forgerl_plugins.trainers.fsdp.trainer:FSDPTrainer",
            options="forgerl_plugins.trainers.fsdp.options:FSDPTrainerOptions",
            description="torch FSDP2 fully_shard, AdamW, DCP checkpoints",
            requires=("torch", "transformers"),
        )
    ]


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "FSDPTrainerOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
