"""One worker process of a :class:`~forgerl.rewards.reward_workers.RewardWorkerPool` and the
thread that feeds it jobs, waits for its answers up to the pool's timeout, and kills and
replaces it when an answer does not come or it dies. The pool's own part, in a module of
its own: the slot reads the pool's job queue and reports starts and failures to it.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

#: (value, sub-components, error): value is None when the reward failed, error says why.
Outcome = tuple["float | None", "dict[str, float]", "str | None"]

#: The worker's command: ``python -m forgerl.rewards.reward_workers FD PARENT_PID``.
WORKER_MODULE = "forgerl.rewards.reward_workers"


@dataclass
class Job:
    """Score ``sample`` with reward ``index`` of the pool's recipes; the answer goes to ``future``."""

    index: int
    sample: Any
    future: Future[Outcome]


log = logging.getLogger("forgerl.rewards")

# A worker that cannot start this many times in a row (its plugin fails to import, its
# reward cannot be built) will not start the next time either: fail fast from then on.
_MAX_START_FAILURES = 3


class PoolState:
    """What the slots of one pool share: the job queue, the limits, the message that tells
    a new worker what to build, and the pool's bookkeeping (whether it is closed or broken,
    what happened to its workers). The pool owns it and hands it to each slot: a slot
    knows nothing else of the pool."""

    def __init__(self, *, size: int, timeout: float, start_timeout: float, init: dict[str, Any]):
        self.size = size
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.init = init
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False
        self.broken: str | None = None  # why workers cannot start, once that is certain
        #: Workers killed for a timeout, workers found dead, workers started (replacements included).
        self.timeouts = self.deaths = self.starts = 0
        #: Seconds from a kill to the replacement reporting ready, one entry per replacement.
        self.replacement_seconds: list[float] = []
        self.started_at = 0.0
        self._start_failures = 0
        self._ready_once = 0  # workers that reported ready; the first `size` of them: the pool is up

    def start_failed(self, why: str) -> None:
        with self.lock:
            if self.closed:  # close() killed a starting worker: not a failure to start
                return
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES and self.broken is None:
                self.broken = why
                log.error("reward workers cannot start; every blocking reward is scored failed: %s", why)
                print(f"forge: error: reward workers cannot start: {why}", file=sys.stderr)

    def worker_ready(self) -> None:
        with self.lock:
            self._start_failures = 0
            self._ready_once += 1
            first_time_all = self._ready_once == self.size
        if first_time_all:
            log.info("%d reward worker processes ready in %.2fs", self.size, time.monotonic() - self.started_at)


class WorkerStartError(Exception):
    """This slot's worker could not start (the pool counts it; see ``PoolState.broken``)."""


class WorkerSlot:
    """One worker process and the thread that feeds it jobs, kills and replaces it."""

    def __init__(self, pool: PoolState, number: int):
        self.pool = pool
        self.number = number
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.ready = False
        self.busy = False
        self.killed_at: float | None = None  # when the previous worker was killed
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name=f"forge-reward-slot-{number}", daemon=True)

    # --------------------------------------------------------------- the thread

    def _serve(self) -> None:
        while True:
            # Take a job only with a worker ready for it: while this worker (re)starts,
            # the other slots take the queue's jobs.
            if not (self.ready or self.pool.closed or self.pool.broken):
                try:
                    self._wait_ready()
                except WorkerStartError:
                    pass  # counted; the next job tries again, or fails once the pool is broken
            job = self.pool.jobs.get()
            if job is None:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(self._run(job))
        self._stop()

    def _run(self, job: Job) -> Outcome:
        pool = self.pool
        for attempt in (1, 2):  # a worker found dead while idle is not the sample's fault
            if pool.closed:
                return failed("the reward workers were closed")
            if pool.broken:
                return failed(f"reward workers cannot start: {pool.broken}")
            try:
                conn = self._wait_ready()
            except WorkerStartError as exc:
                return failed(f"reward worker could not start: {exc}")
            with self._lock:
                if pool.closed:
                    return failed("the reward workers were closed")
                self.busy = True
            try:
                try:
                    conn.send((job.index, job.sample))
                except (OSError, EOFError):
                    self._discard(kill=True)
                    if attempt == 2:
                        return failed("the reward worker died before it took the sample")
                    continue
                except Exception as exc:  # noqa: BLE001 - the sample itself cannot be pickled
                    return failed(f"could not send the sample to a reward worker: {type(exc).__name__}: {exc}")
                return self._answer(conn)
            finally:
                with self._lock:
                    self.busy = False
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(self, conn: Connection) -> Outcome:
        pool = self.pool
        try:
            if conn.poll(pool.timeout):
                outcome = conn.recv()
                return outcome
        except (OSError, EOFError):
            status = self._discard(kill=True)
            if pool.closed:
                return failed("the reward workers were closed")
            pool.deaths += 1
            self._spawn()
            return failed(f"its reward worker died ({describe_status(status)}) and was replaced")
        # Timed out: the reward may be stuck in C with the GIL held, or ignore SIGTERM.
        self._discard(kill=True)
        pool.timeouts += 1
        self.killed_at = time.monotonic()
        self._spawn()
        return failed(f"timed out after {pool.timeout:g}s (its worker was killed and replaced)")

    # --------------------------------------------------------------- worker lifecycle

    def _spawn(self) -> None:
        """Start a worker and send it what it needs to build its rewards (non-blocking:
        it reports ready later, read by :meth:`_wait_ready`)."""
        pool = self.pool
        if pool.closed or pool.broken:
            return
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            pool.start_failed(f"{type(exc).__name__}: {exc}")
            return
        finally:
            theirs.close()
        with self._lock:
            self.proc, self.conn, self.ready = proc, Connection(ours.detach()), False
        pool.starts += 1
        try:
            self.conn.send(pool.init)
        except OSError:
            pass  # it died at once; _wait_ready reports how

    def _wait_ready(self) -> Connection:
        """The connection to this slot's worker once it reported ready, started first if
        there is none. Only this slot's thread sets or clears ``proc`` and ``conn``, together."""
        if self.proc is None or self.conn is None:
            self._spawn()
        conn = self.conn
        if self.proc is None or conn is None:
            raise WorkerStartError(self.pool.broken or "the worker process could not be started")
        if self.ready:
            return conn
        try:
            if not conn.poll(self.pool.start_timeout):
                self._discard(kill=True)
                why = f"not ready within {self.pool.start_timeout:g}s"
                self.pool.start_failed(why)
                raise WorkerStartError(why)
            kind, detail = conn.recv()
        except (OSError, EOFError):
            status = self._discard(kill=True)
            why = f"it exited while starting ({describe_status(status)})"
            self.pool.start_failed(why)
            raise WorkerStartError(why) from None
        if kind != "ready":
            self._discard(kill=True)
            self.pool.start_failed(detail)
            raise WorkerStartError(detail)
        self.ready = True
        self.pool.worker_ready()
        if self.killed_at is not None:
            self.pool.replacement_seconds.append(time.monotonic() - self.killed_at)
            self.killed_at = None
        return conn

    def _discard(self, *, kill: bool) -> int | None:
        """Forget the current worker (SIGKILLed first when ``kill``); its exit status."""
        with self._lock:
            proc, conn = self.proc, self.conn
            self.proc = self.conn = None
            self.ready = False
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if kill and proc.poll() is None:
            proc.kill()
        return proc.wait()

    def _stop(self) -> None:
        """At close: ask an idle worker to exit, kill it if it does not."""
        proc, conn = self.proc, self.conn
        if proc is not None and conn is not None and proc.poll() is None:
            try:
                conn.send(None)
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._discard(kill=True)

    def interrupt(self) -> None:
        """From :meth:`RewardWorkerPool.close`: kill the worker when it is busy or still
        starting, so that its thread sees end-of-file now instead of at a deadline."""
        with self._lock:
            proc = self.proc if self.busy or not self.ready else None
        if proc is not None and proc.poll() is None:
            proc.kill()


def failed(why: str) -> Outcome:
    """The outcome of a sample whose reward could not be computed, saying why."""
    return None, {}, why


def describe_status(status: int | None) -> str:
    """A worker's exit status in words: ``exit status 1``, ``killed by SIGKILL``."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"
