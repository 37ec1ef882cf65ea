"""``torchtitan``: TorchTitan models and parallelism."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from forgerl.backends import TrainerBackend
from forgerl.hookspecs import hookimpl


class TorchTitanTrainerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@hookimpl
def forge_trainers():
    return [
        TrainerBackend(
            name="torchtitan",
            factory=None,
            options=TorchTitanTrainerOptions,
            description="TorchTitan trainer",
            requires=("torchtitan",),
            extra="torchtitan",
            implemented=False,
        )
    ]
