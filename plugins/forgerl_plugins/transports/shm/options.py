"""Options of the backends registered in forgerl_plugins.transports.shm (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ShmTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    directory: str | None = Field(
        None, description="Where versions are written (default: /dev/shm when large enough, else a temp dir)."
    )
    keep_versions: int = Field(2, ge=1, description="Versions kept on disk; older ones are removed.")
    poll_interval: float = Field(0.05, gt=0, description="Seconds between checks while a receiver waits.")
