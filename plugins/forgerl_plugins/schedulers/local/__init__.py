"""``local``: a run's roles as subprocesses on this machine."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return ["forgerl_plugins.schedulers.local.scheduler:LocalScheduler"]
