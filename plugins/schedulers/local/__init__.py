"""``local``: a run's roles as subprocesses on this machine."""

from __future__ import annotations

from forgerl.backends import SchedulerBackend
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


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "LocalSchedulerOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
