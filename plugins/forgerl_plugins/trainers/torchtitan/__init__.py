"""``torchtitan``: TorchTitan's model definitions and parallelism (FSDP2, tensor parallel),
with forgerl's loss, micro-batching and checkpoints (the same update as ``fsdp``)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return ["forgerl_plugins.trainers.torchtitan.trainer:TorchTitanTrainer"]
