"""Options of the backends registered in forgerl_plugins.schedulers.local (imported only when validated)."""

from __future__ import annotations

from pydantic import Field

from forgerl.options import OptionsModel


class LocalSchedulerOptions(OptionsModel):
    stop_timeout: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="Seconds between SIGTERM and SIGKILL when stopping roles (time to checkpoint).",
    )
    master_addr: str = Field("127.0.0.1", description="Rendezvous address for multi-rank roles.")
    oversubscribe: bool = Field(
        False,
        description="Start the run even when its processes need more CPUs than this machine lets forge "
        "use (by default each role must fit the usable cores, and all roles together twice that).",
    )
