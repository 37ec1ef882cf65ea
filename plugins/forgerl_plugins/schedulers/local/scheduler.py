"""The ``local`` scheduler: every process of a job as a subprocess of ``forge run``.

``submit`` starts the processes and returns at once; ``wait`` supervises them in the
foreground (``detached = False``) until the job ends:

* every process of the primary roles (all roles when none is primary) exited 0 →
  the others are stopped, COMPLETED, exit code 0;
* a process exited non-zero → its replica is restarted (all ranks, a fresh
  ``MASTER_PORT``) while its role's ``max_restarts`` allows, else everything is stopped:
  FAILED with that process's exit code (128+N when killed by signal N);
* SIGINT/SIGTERM/SIGHUP to the supervising process, or ``cancel`` from anywhere →
  everything is stopped: CANCELLED, exit code 128+signal (143 for ``cancel``).

"Stopped" means SIGTERM to each process's process group and session (grandchildren
included), SIGKILL after ``stop_timeout``. Every child also gets SIGKILL from the kernel if
the thread that started it dies (PR_SET_PDEATHSIG), so even a SIGKILLed ``forge run`` leaves
no direct child behind. Known limit: a grandchild that called ``setsid`` itself escapes the
stop, and after a SIGKILL of the supervisor grandchildren are not stopped (the kernel only
signals direct children).

Each process runs in the supervisor's working directory with its environment plus the
job's and role's ``env`` plus the variables forge sets (see :func:`jobfile.process_env`).
Files under the run directory are described in :mod:`.jobfile`. The job id of a local job
is the absolute path of its run directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import Field

from forgerl.errors import ConfigError, JobNotFound, SchedulerError
from forgerl.interfaces import Scheduler
from forgerl.options import OptionsModel
from forgerl.types import JobHandle, JobSpec, JobState, JobStatus

from . import jobfile, placement, procs
from .supervisor import LiveJob

_ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_CANCELLED_CODE = 128 + signal.SIGTERM


class LocalScheduler(Scheduler):
    name = "local"
    description = "subprocesses on this machine"

    class Options(OptionsModel):
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

    detached = False
    runs_here = True
    supports_logs = True

    def __init__(self, options: Options | None = None):
        self.options = options if options is not None else LocalScheduler.Options()
        self._jobs: dict[str, LiveJob] = {}

    # ------------------------------------------------------------------ submit / wait

    def check_job(self, job: JobSpec) -> None:
        """Before a run is created: refuse a job this machine cannot hold (more processes than
        cores, more GPUs than visible; see :mod:`.placement`) with one line naming the numbers."""
        _validate(job)
        if not self.options.oversubscribe:
            placement.check_placement(job)

    def submit(self, job: JobSpec) -> JobHandle:
        """Start every process of ``job``; returns at once. Call :meth:`wait` from the same
        thread (the kernel kills the children when the thread that started them ends)."""
        _validate(job)
        run_dir = Path(job.run_dir).expanduser().resolve()
        self._refuse_busy(run_dir)
        try:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            jobfile.clear_cancel(run_dir)
        except OSError as e:
            raise ConfigError(
                f"cannot use run directory {run_dir}: {e.strerror or e}; choose another one"
            ) from None
        live = LiveJob(job, run_dir, self.options.stop_timeout, self.options.master_addr)
        self._jobs[str(run_dir)] = live
        live.start()
        return JobHandle(scheduler="local", job_id=str(run_dir), run_dir=str(run_dir))

    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        """Supervise the job until it ends and return its final status; after ``timeout``
        seconds return the current one instead (the job goes on; ``wait`` again)."""
        live = self._jobs.get(_key(handle.job_id))
        if live is None:  # submitted by another process: watch its record
            return self._watch(handle.job_id, timeout)
        with _caught_signals() as caught:
            return live.supervise(timeout, caught)

    def _watch(self, job_id: str, timeout: float | None) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status(job_id)
            if status.state.finished or status.state is JobState.UNKNOWN:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                return status
            time.sleep(0.5)

    def _refuse_busy(self, run_dir: Path) -> None:
        # Two jobs in one run directory would overwrite each other's job.json and logs.
        if not (run_dir / jobfile.JOB_FILE).is_file():
            return
        try:
            status = self.status(str(run_dir))
        except JobNotFound:
            return
        if not status.state.finished and status.state is not JobState.UNKNOWN:
            raise ConfigError(
                f"run directory {run_dir} is in use by a running local job; "
                f"cancel it (`forge cancel {run_dir}`) or choose another run directory"
            )

    # ------------------------------------------------------------------ from any process

    def status(self, job_id: str) -> JobStatus:
        run_dir = jobfile.resolve_job_dir(job_id)
        record = jobfile.read_job(run_dir)
        try:
            state = JobState(record.get("state"))
        except ValueError:
            state = JobState.UNKNOWN
        if state.finished:
            return JobStatus(state, record.get("exit_code"), record.get("detail", ""))
        original = _copied_from(record, run_dir)
        if original is not None:  # the processes it lists are the original job's, not this copy's
            return JobStatus(
                JobState.UNKNOWN,
                None,
                f"a copy of the run directory {original}, made while its job ran; that job's processes "
                f"are not this directory's (`forge status {original}`)",
            )
        supervisor = record.get("supervisor") or {}
        supervisor_alive = bool(supervisor.get("pid")) and procs.is_alive(
            supervisor["pid"], supervisor.get("starttime")
        )
        running = any(procs.is_alive(p["pid"], p.get("starttime")) for p in _started(record))
        if not running and jobfile.cancel_requested(run_dir):
            return JobStatus(JobState.CANCELLED, _CANCELLED_CODE, "cancelled on request (forge cancel)")
        if supervisor_alive:
            return JobStatus(state, None, record.get("detail", ""))
        if running:
            return JobStatus(
                state,
                None,
                f"the supervising process {supervisor.get('pid')} is gone; its processes still run",
            )
        return JobStatus(
            JobState.UNKNOWN,
            None,
            f"the supervising process {supervisor.get('pid')} ended without recording an outcome "
            f"(killed?); see {run_dir / 'logs' / jobfile.EVENT_LOG}",
        )

    def cancel(self, job_id: str) -> None:
        """Stop every process of the job. Works from any process on this machine; returns once
        the processes are gone (at most about ``stop_timeout`` seconds)."""
        run_dir = jobfile.resolve_job_dir(job_id)
        live = self._jobs.get(str(run_dir))
        if live is not None:
            live.cancel()
            return
        record = jobfile.read_job(run_dir)
        if self.status(str(run_dir)).state.finished:
            return
        original = _copied_from(record, run_dir)
        if original is not None:
            raise JobNotFound(
                f"{run_dir} is a copy of the run directory {original}: the processes its job.json lists "
                f"belong to that run, not to this copy; to stop them, `forge cancel {original}`"
            )
        jobfile.request_cancel(run_dir)  # the supervisor, if alive, records CANCELLED itself
        jobfile.log_event(run_dir, f"cancel requested by pid {os.getpid()}: stopping every process")
        # A live process with another start time took a dead child's pid: not ours to signal.
        leaders = [p["pid"] for p in _started(record) if not procs.pid_reused(p["pid"], p.get("starttime"))]
        procs.stop_trees(leaders, self.options.stop_timeout)
        supervisor = record.get("supervisor") or {}
        if not (supervisor.get("pid") and procs.is_alive(supervisor["pid"], supervisor.get("starttime"))):
            record.update(
                state=JobState.CANCELLED.value,
                exit_code=_CANCELLED_CODE,
                detail="cancelled on request (forge cancel)",
            )
            jobfile.write_job(run_dir, record)
            jobfile.log_event(run_dir, "job cancelled (no supervisor was running)")

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        """Lines of the job's role logs, oldest first, without line ends; each prefixed with
        ``[<log name>] `` when several logs are shown. ``role="scheduler"`` shows the event log."""
        run_dir = jobfile.resolve_job_dir(job_id)
        record = jobfile.read_job(run_dir)
        if role == "scheduler":
            paths = [run_dir / "logs" / jobfile.EVENT_LOG]
        else:
            roles = [r["name"] for r in record.get("roles", [])]
            if role is not None and role not in roles:
                raise JobNotFound(
                    f"job {run_dir} has no role {role!r}; roles: {', '.join([*roles, 'scheduler'])}"
                )
            paths = []
            original = _copied_from(record, run_dir)
            for p in record.get("processes", []):
                path = Path(p["log"])
                if original is not None and path.is_relative_to(original):  # this copy's own logs
                    path = run_dir / path.relative_to(original)
                if (role is None or p["role"] == role) and path not in paths:
                    paths.append(path)
        paths = [p for p in paths if p.is_file()]
        several = len(paths) > 1
        for path in paths:
            prefix = f"[{path.name.removesuffix('.log')}] " if several else ""
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    yield prefix + line.rstrip("\n")

    # ------------------------------------------------------------------ dry run

    def render(self, job: JobSpec) -> str:
        """One block per process: role, replica, rank, the variables forge sets, the command,
        the log file. MASTER_PORT is only known at submit time."""
        _validate(job)
        run_dir = Path(job.run_dir).expanduser().resolve()
        primaries = [r.name for r in job.roles if r.primary] or [r.name for r in job.roles]
        n = sum(r.replicas * r.ranks_per_replica for r in job.roles)
        out = [
            f"# local job {job.name!r}: {n} process{'es' * (n != 1)} on this machine, run dir {run_dir}",
            (
                f"# ends when every process of {', '.join(primaries)} exits 0; then the rest get SIGTERM "
                f"(SIGKILL after {self.options.stop_timeout:g}s)"
            ),
            "",
        ]
        for role in job.roles:
            for replica in range(role.replicas):
                for rank in range(role.ranks_per_replica):
                    env = jobfile.process_env(
                        job,
                        role,
                        replica,
                        rank,
                        run_dir,
                        self.options.master_addr,
                        "<free port chosen at submit>",
                    )
                    notes = [f"rank {rank} of {role.ranks_per_replica}"]
                    if role.name in primaries:
                        notes.append("primary")
                    if role.max_restarts:
                        notes.append(f"restarted up to {role.max_restarts} times")
                    log = (
                        run_dir / "logs" / jobfile.log_name(role.name, replica, rank, role.ranks_per_replica)
                    )
                    out.append(f"# role {role.name}, replica {replica}, {', '.join(notes)}")
                    out.append(f"# log: {log}")
                    words = [f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(role.command)]
                    out.append("env " + " \\\n    ".join(words))
                    out.append("")
        return "\n".join(out)


# ---------------------------------------------------------------------- helpers


def _key(job_id: str) -> str:
    return str(Path(job_id).expanduser().resolve())


def _started(record: dict) -> list[dict]:
    return [p for p in record.get("processes", []) if p.get("pid")]


def _copied_from(record: dict[str, Any], run_dir: Path) -> Path | None:
    """The run directory a job record was written in, when that is not ``run_dir``: the
    directory was copied or moved, and the pids and log paths in the record are the
    original's."""
    recorded = record.get("run_dir")
    if not recorded or Path(recorded).resolve() == run_dir:
        return None
    return Path(recorded)


def _validate(job: JobSpec) -> None:
    if not job.roles:
        raise SchedulerError(f"job {job.name!r} has no roles")
    seen: set[str] = set()
    for role in job.roles:
        if not _ROLE_NAME.fullmatch(role.name):
            raise SchedulerError(
                f"role name {role.name!r} must be letters, digits, '_', '.', '-' (it names log files)"
            )
        if role.name in seen or role.name == "scheduler":
            raise SchedulerError(f"role name {role.name!r} is used twice or reserved")
        seen.add(role.name)
        if not role.command:
            raise SchedulerError(f"role {role.name!r} has an empty command")
        if role.replicas < 1 or role.ranks_per_replica < 1 or role.max_restarts < 0:
            raise SchedulerError(
                f"role {role.name!r}: replicas ({role.replicas}) and ranks_per_replica "
                f"({role.ranks_per_replica}) must be >= 1, max_restarts ({role.max_restarts}) >= 0"
            )


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
    """Turn SIGINT/SIGTERM/SIGHUP into entries of a list while the block runs.

    Only the main thread can install handlers; elsewhere the list stays empty. A signal
    the process ignores (``nohup``) stays ignored: the user asked to survive it.
    """
    caught: list[int] = []
    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(sig)
            if handler == signal.SIG_IGN:
                continue
            previous[sig] = handler
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
