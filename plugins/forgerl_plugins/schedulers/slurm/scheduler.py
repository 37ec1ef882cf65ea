"""The ``slurm`` scheduler: sbatch to submit; squeue, scontrol and ``sacct -c`` to watch;
scancel to cancel; the per-role log files in the run directory for logs.

Everything goes through the Slurm command-line tools (pyslurm does not build against
every Slurm release; the tools are on every login node).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, TypeAlias

from forgerl.errors import BackendUnavailable, JobNotFound, SchedulerError, UserError
from forgerl.interfaces import Scheduler
from forgerl.rundirs.diskerrors import write_failed
from forgerl.rundirs.runs import atomic_write_text
from forgerl.types import JobHandle, JobSpec, JobState, JobStatus
from forgerl_plugins.schedulers.slurm.options import Options as _Options
from forgerl_plugins.schedulers.slurm.render import render_script, run_dir_of

log = logging.getLogger("forgerl.scheduler.slurm")

# Slurm job states (squeue %T, scontrol JobState, sacct State) → ours.
_STATES = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    # The batch script has exited but steps are still being cleaned up.
    "COMPLETING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "PREEMPTED": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
}


class SbatchRejected(SchedulerError, UserError):
    """sbatch refused the job (unknown partition, account, QoS, impossible resources)."""


class SlurmUnreachable(SchedulerError, UserError):
    """The Slurm controller did not answer."""


def _state(text: str) -> JobState:
    # sacct prints "CANCELLED by 0"; squeue and scontrol print the bare name.
    return _STATES.get(text.split()[0].upper() if text.strip() else "", JobState.UNKNOWN)


def _exit_code(text: str) -> int | None:
    """Slurm's "CODE:SIGNAL" → a shell-style status (128+signal when killed by one)."""
    m = re.match(r"(\d+):(\d+)", text.strip())
    if not m:
        return None
    code, sig = int(m[1]), int(m[2])
    return 128 + sig if sig else code


def _detail(state: JobState, state_name: str, reason: str, restarts: int) -> str:
    """What Slurm says beyond our state: its own state when it differs (TIMEOUT,
    OUT_OF_MEMORY, REQUEUED, ...), why a job waits or ended, how often it restarted."""
    parts = []
    if state_name.strip() and state_name.split()[0].lower() != state.value:
        parts.append(state_name)
    if reason not in ("None", "", "NonZeroExitCode"):
        parts.append(f"reason: {reason}")
    if restarts:
        parts.append(f"restarted {restarts}x")
    return ", ".join(parts)


def _one_line(stderr: str) -> str:
    parts = [re.sub(r"^\w+: (error|fatal): ", "", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    # sbatch states the cause first and then "Batch job submission failed: <same cause>".
    return "; ".join(dict.fromkeys(parts)) or "no message"


class SlurmScheduler(Scheduler):
    name = "slurm"
    description = "Slurm batch jobs (sbatch/srun)"
    info: ClassVar[dict[str, str]] = {"needs": "sbatch, squeue, scontrol, scancel on PATH (a Slurm login node)"}

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    detached = True
    supports_logs = True

    def __init__(self, options: Options | None = None):
        self.options = options or SlurmScheduler.Options()

    # ------------------------------------------------------------------ submit

    def render(self, job: JobSpec) -> str:
        return render_script(job, self.options)

    def submit(self, job: JobSpec) -> JobHandle:
        script = self.render(job)  # bad input fails here, before anything is written
        sbatch = self._tool("sbatch")
        run_dir = Path(run_dir_of(job))
        path = run_dir / "slurm" / "job.sbatch"
        try:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, script)  # never a half script for sbatch to queue
        except OSError as exc:
            raise write_failed(path, exc, "run the command again") from None
        proc = self._run([sbatch, "--parsable", str(path)])
        if proc.returncode != 0:
            msg = _one_line(proc.stderr)
            hint = ""
            if "partition" in msg.lower():
                hint = " (`sinfo -s` lists the partitions; set scheduler.options.partition)"
            raise SbatchRejected(f"sbatch rejected job {job.name!r}: {msg}{hint}")
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SchedulerError(f"sbatch printed {proc.stdout.strip()!r} where a job id was expected")
        try:
            atomic_write_text(run_dir / "slurm" / "job_id", job_id + "\n")
        except OSError as exc:  # the job is queued; submission.json (forge run) records its id too
            log.warning("could not write %s: %s", run_dir / "slurm" / "job_id", exc)
        _remember(job_id, run_dir)
        log.info("submitted Slurm job %s (script %s)", job_id, path)
        return JobHandle(scheduler="slurm", job_id=job_id, run_dir=str(run_dir))

    # ------------------------------------------------------------------- watch

    def status(self, job_id: str) -> JobStatus:
        job_id = self._job_id(job_id)
        fields = self._scontrol(job_id)
        if fields is not None:
            state_name = fields.get("JobState", "")
            state = _state(state_name)
            restarts = int(fields.get("Restarts", "0") or 0)
            detail = _detail(state, state_name, fields.get("Reason", "None"), restarts)
            code = _exit_code(fields.get("ExitCode", "")) if state.finished else None
            return JobStatus(state=state, exit_code=code, detail=detail)
        # Purged from the controller's memory (MinJobAge): the completion log knows it.
        record = self._sacct(job_id)
        if record is None:
            raise JobNotFound(f"Slurm knows no job {job_id} (`squeue`/`sacct` list the jobs it knows)")
        state_name, exit_text = record
        state = _state(state_name)
        return JobStatus(state=state, exit_code=_exit_code(exit_text) if state.finished else None,
                         detail=_detail(state, state_name, "None", 0))

    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            st = self.status(handle.job_id)
            if (st.state, st.detail) != last:
                log.info("Slurm job %s: %s", handle.job_id, st.detail or st.state.value)
                last = (st.state, st.detail)
            if st.state.finished:
                return st
            if deadline is not None and time.monotonic() >= deadline:
                raise SchedulerError(f"Slurm job {handle.job_id} still {st.state.value} after {timeout:g}s")
            time.sleep(self.options.poll_interval)

    def cancel(self, job_id: str) -> None:
        job_id = self._job_id(job_id)
        if self.status(job_id).state.finished:
            return
        proc = self._run([self._tool("scancel"), job_id])
        if proc.returncode != 0:
            raise SchedulerError(f"scancel {job_id} failed: {_one_line(proc.stderr)}")

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        """Lines of the role logs (``logs/<role>-<replica>.log``, all ranks of a replica in
        one, prefixed by rank when several), oldest first; each prefixed with ``[<log name>] ``
        when several logs are shown. ``role="scheduler"`` shows the batch script's output."""
        job_id = self._job_id(job_id)
        logs = self._run_dir(job_id) / "logs"
        batch = logs / f"slurm-{job_id}.out"
        role_logs = sorted(logs.glob("*-*.log"))
        if role == "scheduler":
            paths = [batch]
        elif role is None:
            paths = [batch, *role_logs]
        else:
            paths = [p for p in role_logs if p.stem.rsplit("-", 1)[0] == role]
            if not paths:
                roles = sorted({p.stem.rsplit("-", 1)[0] for p in role_logs})
                raise JobNotFound(f"job {job_id} has no logs of role {role!r}; roles: {', '.join([*roles, 'scheduler'])}")
        paths = [p for p in paths if p.is_file()]
        several = len(paths) > 1
        for path in paths:
            prefix = f"[{'scheduler' if path == batch else path.stem}] " if several else ""
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    yield prefix + line.rstrip("\n")

    def check(self) -> None:
        self._tool("sbatch")

    # ----------------------------------------------------------------- helpers

    def _tool(self, name: str) -> str:
        path = shutil.which(name)
        if path is None:
            raise BackendUnavailable(
                f"{name} not found on PATH: run forge on a Slurm login node or install the Slurm "
                "client tools (e.g. apt-get install slurm-client)"
            )
        return path

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            raise SlurmUnreachable(f"{Path(argv[0]).name} did not answer in 120 s: is slurmctld up?") from None
        if proc.returncode != 0 and "Unable to contact slurm controller" in proc.stderr:
            raise SlurmUnreachable(f"{Path(argv[0]).name}: the Slurm controller did not answer (slurmctld down?)")
        return proc

    @staticmethod
    def _job_id(job_id: str) -> str:
        job_id = str(job_id).strip()
        if not re.fullmatch(r"\d+", job_id):
            raise JobNotFound(f"{job_id!r} is not a Slurm job id (a number, as sbatch printed it)")
        return job_id

    def _scontrol(self, job_id: str) -> dict[str, str] | None:
        """The controller's record of the job (None once purged). One field per key; the
        values we use contain no spaces, except Comment, which sits alone on its line."""
        proc = self._run([self._tool("scontrol"), "show", "job", job_id])
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise SchedulerError(f"scontrol show job {job_id} failed: {_one_line(proc.stderr)}")
        fields: dict[str, str] = {}
        for line in proc.stdout.splitlines():
            line = line.strip()
            if line.startswith("Comment="):
                fields["Comment"] = line[len("Comment="):]
                continue
            for key, value in re.findall(r"(\w+)=(\S*)", line):
                fields.setdefault(key, value)
        return fields

    def _sacct(self, job_id: str) -> tuple[str, str] | None:
        """(State, ExitCode) of the job's last attempt from the job completion log."""
        sacct = shutil.which("sacct")
        if sacct is None:
            return None
        proc = self._run([sacct, "-c", "-j", job_id, "-n", "-P", "-o", "JobID,State,ExitCode"])
        if proc.returncode != 0:
            return None
        rows = [ln.split("|") for ln in proc.stdout.splitlines() if ln.split("|")[0] == job_id]
        return (rows[-1][1], rows[-1][2]) if rows else None

    def _run_dir(self, job_id: str) -> Path:
        fields = self._scontrol(job_id)
        comment = (fields or {}).get("Comment", "")
        if comment.startswith("forgerl run_dir="):
            return Path(comment[len("forgerl run_dir="):].rstrip())
        remembered = _recall(job_id)
        if remembered is not None:
            return remembered
        if fields is None:
            raise JobNotFound(f"Slurm knows no job {job_id}, and it was not submitted by forge from this machine")
        raise UserError(f"Slurm job {job_id} was not submitted by forge: it has no run directory")


# Job id → run directory, for `forge logs` once the controller has forgotten a job. The
# run directory itself also records its job id (run_dir/slurm/job_id).


def _index_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "forgerl" / "slurm-jobs"


def _remember(job_id: str, run_dir: Path) -> None:
    try:
        d = _index_dir()
        d.mkdir(parents=True, exist_ok=True)
        (d / job_id).write_text(str(run_dir) + "\n")
    except OSError as exc:  # an unwritable home must not fail a submitted job
        log.warning("could not record job %s in %s: %s", job_id, _index_dir(), exc)


def _recall(job_id: str) -> Path | None:
    try:
        run_dir = Path((_index_dir() / job_id).read_text().strip())
        # Job ids start again when a cluster's state is reset: trust the entry only when
        # the run directory still names this job as its own.
        if (run_dir / "slurm" / "job_id").read_text().strip() == job_id:
            return run_dir
    except OSError:
        pass
    return None
