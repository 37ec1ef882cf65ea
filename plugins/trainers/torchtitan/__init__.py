"""``torchtitan``: TorchTitan models and parallelism."""

from __future__ import annotations

from forgerl.backends import TrainerBackend
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


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "TorchTitanTrainerOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
