"""``local``: a run's roles as subprocesses on this machine."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import SchedulerBackend
from forgerl.hookspecs import hookimpl


class LocalSchedulerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stop_timeout: float = Field(10.0, gt=0, description="Seconds between SIGTERM and SIGKILL when stopping roles.")
    master_addr: str = Field("127.0.0.1", description="Rendezvous address for multi-rank roles.")


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="local",
            factory="forgerl_plugins.schedulers.local.scheduler:LocalScheduler",
            options=LocalSchedulerOptions,
            description="subprocesses on this machine",
        )
    ]
