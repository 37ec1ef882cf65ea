"""``torchtitan``: TorchTitan's model definitions and parallelism (FSDP2, tensor parallel),
with forgerl's loss, micro-batching and checkpoints (the same update as ``fsdp``)."""

from __future__ import annotations

from forgerl.backends import TrainerBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="torchtitan",
            factory="forgerl_plugins.trainers.torchtitan.trainer:TorchTitanTrainer",
            options="forgerl_plugins.trainers.torchtitan.options:TorchTitanTrainerOptions",
            description="TorchTitan Llama 3 / Qwen models, FSDP2 + tensor parallel, DCP checkpoints",
            local_preflight="forgerl_plugins.trainers.shared.distributed:local_preflight",
            requires=("torch", "torchtitan", "spmd_types", "tyro", "safetensors"),
            extra="torchtitan",
            # Not the plain extra: TorchTitan's declared dependencies would replace torch.
            install_hint="pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro typeguard "
            "(scripts/setup.sh does)",
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("TorchTitanTrainerOptions",))
