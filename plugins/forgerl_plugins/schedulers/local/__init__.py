"""``local``: a run's roles as subprocesses on this machine."""

from __future__ import annotations

from forgerl.backends import SchedulerBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="local",
            factory="forgerl_plugins.schedulers.local.scheduler:LocalScheduler",
            options="forgerl_plugins.schedulers.local.options:LocalSchedulerOptions",
            description="subprocesses on this machine",
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("LocalSchedulerOptions",))
