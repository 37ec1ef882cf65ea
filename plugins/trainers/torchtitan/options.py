"""Options of the backends registered in forgerl_plugins.trainers.torchtitan (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class TorchTitanTrainerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
