"""A local job while it runs: its processes, their restarts, and the rules that end it.

The supervisor lives in the process that called ``submit`` (``forge run``): it holds the
``Popen`` objects, polls them, restarts replicas that may be restarted, stops everything
when the job ends, and keeps ``job.json`` current for other processes.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.types import JobSpec, JobState, JobStatus, RoleSpec

from . import jobfile, procs

POLL_INTERVAL = 0.1  # seconds between polls of the children while supervising


@dataclass
class Proc:
    """One started (or failed-to-start) process: one rank of one replica of one role."""

    role: RoleSpec
    replica: int
    rank: int
    log: Path
    master_port: int
    restarts: int = 0
    popen: subprocess.Popen | None = None
    starttime: int | None = None
    exit_code: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    @property
    def label(self) -> str:
        rank = f" rank {self.rank}" if self.role.ranks_per_replica > 1 else ""
        return f"{self.role.name}-{self.replica}{rank}"

    def describe(self) -> str:
        return f"role {self.role.name!r} replica {self.replica} rank {self.rank}"

    def record(self) -> dict[str, Any]:
        return {
            "role": self.role.name,
            "replica": self.replica,
            "rank": self.rank,
            "pid": self.pid,
            # Each process leads its own session, so its process group id is its pid.
            "pgid": self.pid,
            "starttime": self.starttime,
            "log": str(self.log),
            "master_port": self.master_port,
            "restarts": self.restarts,
            "exit_code": self.exit_code,
            "command": list(self.role.command),
        }


@dataclass
class Replica:
    role: RoleSpec
    index: int
    port: int = 0
    restarts: int = 0
    procs: list[Proc] = field(default_factory=list)


class LiveJob:
    """A job submitted by this process. Not thread-safe beyond: one thread supervises (``wait``)
    while others may call :meth:`cancel`, which then only leaves a request for it."""

    def __init__(self, spec: JobSpec, run_dir: Path, stop_timeout: float, master_addr: str):
        self.spec = spec
        self.run_dir = run_dir
        self.stop_timeout = stop_timeout
        self.master_addr = master_addr
        self.replicas = [Replica(role, i) for role in spec.roles for i in range(role.replicas)]
        primaries = {role.name for role in spec.roles if role.primary}
        # No primary role: the job is all roles, done when every process exits 0.
        self.primary_roles = primaries or {role.name for role in spec.roles}
        self.state = JobState.PENDING
        self.exit_code: int | None = None
        self.detail = ""
        self.supervising = False
        self._lock = threading.RLock()
        self._created = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._supervisor = {"pid": os.getpid(), "starttime": procs.start_time(os.getpid())}

    @property
    def status(self) -> JobStatus:
        return JobStatus(self.state, self.exit_code, self.detail)

    def all_procs(self) -> list[Proc]:
        return [p for rep in self.replicas for p in rep.procs]

    # ------------------------------------------------------------------ starting

    def start(self) -> None:
        with self._lock:
            self._write()
            n = sum(r.ranks_per_replica * r.replicas for r in self.spec.roles)
            jobfile.log_event(
                self.run_dir, f"job {self.spec.name!r}: starting {n} processes (supervisor pid {os.getpid()})"
            )
            try:
                ports = procs.free_ports(self.master_addr, len(self.replicas))
            except OSError as e:
                self._finish(JobState.FAILED, 1, f"cannot choose rendezvous ports on {self.master_addr}: {e}")
                return
            for rep, port in zip(self.replicas, ports):
                rep.port = port
                if not self._spawn(rep):
                    return
            self.state = JobState.RUNNING
            self._write()

    def _spawn(self, rep: Replica) -> bool:
        """Start every rank of ``rep``. On a start failure: stop the job, FAILED; returns False."""
        role = rep.role
        rep.procs = []
        for rank in range(role.ranks_per_replica):
            log = self.run_dir / "logs" / jobfile.log_name(role.name, rep.index, rank, role.ranks_per_replica)
            proc = Proc(role, rep.index, rank, log, rep.port, restarts=rep.restarts)
            rep.procs.append(proc)
            env = dict(os.environ)
            env.update(
                jobfile.process_env(
                    self.spec, role, rep.index, rank, self.run_dir, self.master_addr, rep.port
                )
            )
            try:
                with open(log, "ab") as out:
                    if rep.restarts or out.tell() > 0:  # a restart, or a run directory used again
                        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
                        why = f"restart {rep.restarts}" if rep.restarts else "new job in this run directory"
                        out.write(
                            f"----- forge local: {proc.label} started again at {stamp} ({why}) -----\n".encode()
                        )
                        out.flush()
                    proc.popen = subprocess.Popen(
                        list(role.command),
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        # Only a libc call runs in the child; glibc's fork handlers keep that safe.
                        preexec_fn=procs.die_with_parent(),  # noqa: PLW1509
                    )
            except OSError as e:
                # 127/126: what a shell reports for "not found" / "cannot execute".
                proc.exit_code = 127 if isinstance(e, FileNotFoundError) else 126
                why = f"cannot start {role.command[0]!r}: {e.strerror or e}"
                with open(log, "a") as out:
                    out.write(f"forge local: {why}\n")
                jobfile.log_event(self.run_dir, f"{proc.label}: {why}")
                self._stop_all()
                self._finish(JobState.FAILED, proc.exit_code, f"{proc.describe()}: {why}; log: {log}")
                return False
            proc.starttime = procs.start_time(proc.popen.pid)
            jobfile.log_event(
                self.run_dir,
                f"started {proc.label} pid {proc.pid} port {rep.port}: {shlex.join(role.command)}",
            )
        return True

    # ------------------------------------------------------------------ supervising

    def supervise(self, timeout: float | None, caught: list[int]) -> JobStatus:
        """Poll until the job ends (or ``timeout`` passes: the status then says RUNNING).

        ``caught`` fills with signal numbers the supervising process receives: the first
        cancels the job, a second one makes the stop skip the SIGTERM grace period.
        """
        if self.state.finished:
            return self.status
        deadline = None if timeout is None else time.monotonic() + timeout
        self.supervising = True
        try:
            while True:
                with self._lock:
                    if self.state.finished:
                        return self.status
                    if caught:
                        sig = caught[0]
                        name = signal.Signals(sig).name
                        jobfile.log_event(self.run_dir, f"supervisor received {name}: stopping every process")
                        self._stop_all(hurry=lambda: len(caught) > 1)
                        return self._finish(
                            JobState.CANCELLED,
                            128 + sig,
                            f"stopped by {name} to the supervising process {os.getpid()}",
                        )
                    if jobfile.cancel_requested(self.run_dir):
                        self._stop_all(hurry=lambda: bool(caught))
                        return self._finish(
                            JobState.CANCELLED, 128 + signal.SIGTERM, "cancelled on request (forge cancel)"
                        )
                    outcome = self._step(hurry=lambda: bool(caught))
                    if outcome is not None:
                        return outcome
                if deadline is not None and time.monotonic() >= deadline:
                    return self.status
                time.sleep(POLL_INTERVAL)
        except BaseException as e:
            # Never leave the processes running unsupervised behind an exception.
            with self._lock:
                if not self.state.finished:
                    self._stop_all()
                    self._finish(JobState.FAILED, None, f"the supervisor failed: {e!r}")
            raise
        finally:
            self.supervising = False

    def _step(self, hurry: Callable[[], bool]) -> JobStatus | None:
        exited: list[Proc] = []
        for p in self.all_procs():
            if p.exit_code is None and p.popen is not None:
                rc = p.popen.poll()
                if rc is not None:
                    p.exit_code = procs.exit_code(rc)
                    exited.append(p)
                    jobfile.log_event(
                        self.run_dir, f"{p.label} pid {p.pid} exited with {procs.describe_exit(p.exit_code)}"
                    )
        if not exited:
            return None
        primaries = [p for p in self.all_procs() if p.role.name in self.primary_roles]
        # The job's purpose is done: a server that failed meanwhile does not matter any more.
        if all(p.exit_code == 0 for p in primaries):
            self._stop_all(hurry)
            roles = ", ".join(sorted(self.primary_roles))
            return self._finish(JobState.COMPLETED, 0, f"every process of {roles} exited 0")
        restarted: set[int] = set()
        for p in exited:
            if p.exit_code == 0:
                continue
            rep = next(r for r in self.replicas if r.role is p.role and r.index == p.replica)
            if id(rep) in restarted:
                continue
            if rep.restarts < rep.role.max_restarts:
                restarted.add(id(rep))
                if not self._restart(rep, p, hurry):
                    return self.status
                continue
            self._stop_all(hurry)
            return self._finish(JobState.FAILED, p.exit_code, self._failure_detail(p, rep))
        self._write()
        return None

    def _restart(self, rep: Replica, cause: Proc, hurry: Callable[[], bool]) -> bool:
        rep.restarts += 1
        jobfile.log_event(
            self.run_dir,
            f"restarting {rep.role.name}-{rep.index} (restart {rep.restarts} of {rep.role.max_restarts}): "
            f"{cause.label} exited with {procs.describe_exit(cause.exit_code or 0)}",
        )
        # All ranks go: an SPMD group cannot take a new member mid-run. Stopping the dead
        # rank's tree too removes grandchildren it left behind.
        self._stop(rep.procs, hurry)
        try:
            rep.port = procs.free_ports(self.master_addr, 1)[0]  # a fresh rendezvous
        except OSError as e:
            self._stop_all(hurry)
            self._finish(JobState.FAILED, cause.exit_code, f"cannot restart {cause.describe()}: {e}")
            return False
        return self._spawn(rep)

    def _failure_detail(self, p: Proc, rep: Replica) -> str:
        after = f" after {rep.restarts} restart{'s' * (rep.restarts != 1)}" if rep.restarts else ""
        last = jobfile.last_line(p.log)
        said = f" (last log line: {last})" if last else ""
        return (
            f"{p.describe()} exited with {procs.describe_exit(p.exit_code or 0)}{after}{said}; log: {p.log}"
        )

    # ------------------------------------------------------------------ stopping

    def _stop(self, targets: list[Proc], hurry: Callable[[], bool] = lambda: False) -> None:
        def reap() -> None:
            for p in targets:
                if p.popen is not None and p.exit_code is None:
                    rc = p.popen.poll()
                    if rc is not None:
                        p.exit_code = procs.exit_code(rc)

        running = [p.label for p in targets if p.popen is not None and p.exit_code is None]
        if running:
            jobfile.log_event(self.run_dir, f"stopping {', '.join(running)}")
        # Exited leaders too: their groups may still hold grandchildren.
        leaders = [p.pid for p in targets if p.pid is not None]
        killed = procs.stop_trees(leaders, self.stop_timeout, reap=reap, hurry=hurry)
        if killed:
            jobfile.log_event(self.run_dir, f"SIGKILL sent to the process trees of pids {killed}")

    def _stop_all(self, hurry: Callable[[], bool] = lambda: False) -> None:
        self._stop(self.all_procs(), hurry)

    def cancel(self) -> None:
        """Cancel from this process: stop now, or ask the supervising thread to."""
        with self._lock:
            if self.state.finished:
                return
            jobfile.request_cancel(self.run_dir)
            if self.supervising:
                return
            jobfile.log_event(self.run_dir, "cancel requested: stopping every process")
            self._stop_all()
            self._finish(JobState.CANCELLED, 128 + signal.SIGTERM, "cancelled on request (forge cancel)")

    # ------------------------------------------------------------------ recording

    def _finish(self, state: JobState, exit_code: int | None, detail: str) -> JobStatus:
        self.state, self.exit_code, self.detail = state, exit_code, detail
        self._write()
        jobfile.log_event(self.run_dir, f"job {state.value} (exit code {exit_code}): {detail}")
        return self.status

    def _write(self) -> None:
        jobfile.write_job(
            self.run_dir,
            {
                "format": jobfile.FORMAT_VERSION,
                "scheduler": "local",
                "job_id": str(self.run_dir),
                "name": self.spec.name,
                "run_dir": str(self.run_dir),
                "state": self.state.value,
                "exit_code": self.exit_code,
                "detail": self.detail,
                "supervisor": self._supervisor,
                "created": self._created,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "roles": [
                    {
                        "name": r.name,
                        "replicas": r.replicas,
                        "ranks_per_replica": r.ranks_per_replica,
                        "primary": r.name in self.primary_roles,
                        "max_restarts": r.max_restarts,
                        "command": list(r.command),
                    }
                    for r in self.spec.roles
                ],
                "processes": [p.record() for p in self.all_procs()],
            },
        )
