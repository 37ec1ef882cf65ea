"""Options of the backends registered in forgerl_plugins.schedulers.local (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LocalSchedulerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stop_timeout: float = Field(
        30.0, gt=0, description="Seconds between SIGTERM and SIGKILL when stopping roles (time to checkpoint)."
    )
    master_addr: str = Field("127.0.0.1", description="Rendezvous address for multi-rank roles.")
