"""A plugin of deliberately broken schedulers, each the ``local`` scheduler with one rule of
the scheduler kit (:class:`forgerl.testing.SchedulerContract`) broken: the tests of the kit
show that each check can fail. Loaded by import path
(``plugins = ("tests.helpers.kit_fake_schedulers",)``). Each is one class with a name of its
own; its options model, description and the rest are ``local``'s, inherited."""

from __future__ import annotations

import os
import signal

from forgerl.hookspecs import hookimpl
from forgerl.types import JobHandle, JobState, JobStatus
from forgerl_plugins.schedulers.local.scheduler import LocalScheduler


class CancelSparesChildren(LocalScheduler):
    """Cancel kills each role's own process, not its process tree: the role's child lives on."""

    name = "kit_cancel_spares_children"

    def cancel(self, job_id: str) -> None:
        live = self._jobs[job_id]
        for proc in live.all_procs():
            os.kill(proc.pid, signal.SIGKILL)
            proc.popen.wait()
        live._finish(JobState.CANCELLED, 143, "cancelled")


class LosesExitCode(LocalScheduler):
    """Reports a failed job without the exit status of the role that failed it."""

    name = "kit_loses_exit_code"

    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        status = super().wait(handle, timeout)
        return JobStatus(status.state, None if status.state is JobState.FAILED else status.exit_code, status.detail)


class UnknownJobIsKeyError(LocalScheduler):
    """Answers an unknown job id with a KeyError instead of JobNotFound."""

    name = "kit_unknown_job_is_key_error"

    def status(self, job_id: str) -> JobStatus:
        if job_id not in self._jobs:
            raise KeyError(job_id)
        return super().status(job_id)


class HidesItsLogs(LocalScheduler):
    """Implements logs() but says it has none: `forge logs` would never show them."""

    name = "kit_hides_its_logs"

    supports_logs = False


@hookimpl
def forge_schedulers():
    return [CancelSparesChildren, LosesExitCode, UnknownJobIsKeyError, HidesItsLogs]
