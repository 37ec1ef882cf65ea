"""``torchtitan``: TorchTitan models and parallelism."""

from __future__ import annotations

from forgerl.backends import TrainerBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="torchtitan",
            factory=None,
            options="forgerl_plugins.trainers.torchtitan.options:TorchTitanTrainerOptions",
            description="TorchTitan trainer",
            requires=("torchtitan",),
            extra="torchtitan",
            implemented=False,
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("TorchTitanTrainerOptions",))
