"""Worker processes for blocking rewards: a reward that hangs or crashes costs one process.

A thread cannot be stopped, and a reward stuck in C code that holds the GIL (a regular
expression backtracking catastrophically) stops every thread of the trainer with it. So
:meth:`Reward.score` runs in a small pool of worker processes, and a sample that outlives
its timeout gets its worker SIGKILLed (a reward may ignore SIGTERM) and replaced.

- A worker is a fresh interpreter (``python -m forgerl.rewards.reward_workers FD``, started with
  subprocess, so effectively the *spawn* method): the trainer has threads and maybe torch,
  where fork is unsafe; and unlike multiprocessing's spawn it re-imports neither the
  parent's ``__main__`` nor starts a resource-tracker process that would outlive the pool.
- A worker builds its rewards itself, from the registry, by backend name and options
  (:class:`RewardRecipe`): reward objects never cross the pipe, which they often could not
  (open clients, loaded models). Only the sample goes there, and the outcome comes back as
  plain data ``(value or None, sub-components, error or None)``.
- One slot thread per worker takes (reward, sample) jobs from a shared queue, waits for
  its worker's answer up to the timeout, and kills and restarts it when the answer does not
  come or the worker dies. Replacements start at once, so the pool never shrinks.
- Workers start in the background (:meth:`RewardWorkerPool.start`) and live as long as the
  pool; the time a job waits for a starting worker does not count against its timeout.
- A worker dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and end-of-file on its
  pipe), so even a SIGKILLed trainer leaves no reward process behind.

The pool and the worker process's ``main`` are here; a slot (one worker and its thread)
is :mod:`forgerl.rewards.reward_slots`.
"""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import queue
import signal
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from forgerl.rewards.reward_slots import Job, PoolState, WorkerSlot, failed
from forgerl.rewards.reward_slots import (
    Outcome as Outcome,  # re-exported: what the pool's futures complete with
)

log = logging.getLogger("forgerl.rewards")

@dataclass(frozen=True)
class RewardRecipe:
    """How a worker process builds a reward: the backend's name and its options as plain
    data (already validated by the parent, which built the same reward to check them)."""

    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)


def default_pool_size() -> int:
    """The cores this process may use, at least 2 (one stuck reward must not stall all
    scoring while its replacement starts) and at most 8 (each worker holds its rewards'
    imports in memory, ~100 MB with math-verify)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(2, min(8, cores))


class RewardWorkerPool:
    """``size`` worker processes running the rewards of ``recipes`` (by position).

    :meth:`submit` returns a future that always completes with an :data:`Outcome`, never
    an exception: within ``timeout`` seconds once a worker has taken the job (plus the time
    to kill it), or at once when the pool is closed or its workers cannot start.
    """

    def __init__(
        self,
        recipes: Sequence[RewardRecipe],
        *,
        size: int,
        timeout: float,
        plugins: Sequence[str] = (),
        start_timeout: float = 120.0,
    ):
        if size < 1:
            raise ValueError(f"a reward pool needs at least one worker, got size={size}")
        self.recipes = list(recipes)
        self.size = size
        init = {
            "sys_path": list(sys.path),
            "plugins": list(plugins),
            "recipes": [(r.backend, dict(r.options)) for r in self.recipes],
        }
        self._state = PoolState(size=size, timeout=timeout, start_timeout=start_timeout, init=init)
        self._slots: list[WorkerSlot] = []
        # The run may end without closing the pool (an exception, an embedding caller that
        # forgot): close it at interpreter exit. A weak reference, so that registering does
        # not keep every pool alive.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            pool = ref()
            if pool is not None:
                pool.close()

        self._at_exit = close_at_exit
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        """Start the workers in the background (returns at once); idempotent. A worker is
        started by its own long-lived slot thread: the kernel's parent-death signal follows
        the *thread* that started a process, so a short-lived caller's thread must not."""
        with self._state.lock:
            if self._state.closed or self._slots:
                return
            self._state.started_at = time.monotonic()
            self._slots = [WorkerSlot(self._state, i) for i in range(self.size)]
            for slot in self._slots:
                slot.thread.start()

    def submit(self, index: int, sample: Any) -> Future[Outcome]:
        """Score ``sample`` with reward ``index`` of the recipes."""
        future: Future[Outcome] = Future()
        if self._state.closed:
            future.set_result(failed("the reward workers were closed"))
            return future
        self.start()
        self._state.jobs.put(Job(index, sample, future))
        return future

    def pids(self) -> list[int]:
        """Process ids of the workers running now."""
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.poll() is None]

    def close(self) -> None:
        """Stop every worker (politely when idle, SIGKILL when busy) and wait for them;
        jobs not yet answered complete as failed. Idempotent."""
        with self._state.lock:
            if self._state.closed:
                return
            self._state.closed = True
            slots = list(self._slots)
        atexit.unregister(self._at_exit)
        for _ in slots:
            self._state.jobs.put(None)
        for slot in slots:
            slot.interrupt()
        for slot in slots:
            slot.thread.join(self.start_timeout)
        # Jobs queued behind the stop marks, or submitted while closing.
        while True:
            try:
                job = self._state.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_result(failed("the reward workers were closed"))

    def __enter__(self) -> RewardWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what happened (read-only)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def broken(self) -> str | None:
        """Why workers cannot start, once that is certain (every job then fails at once)."""
        return self._state.broken

    @property
    def timeout(self) -> float:
        return self._state.timeout

    @property
    def start_timeout(self) -> float:
        return self._state.start_timeout

    @property
    def timeouts(self) -> int:
        """Workers killed because a sample outlived the timeout."""
        return self._state.timeouts

    @property
    def deaths(self) -> int:
        """Workers found dead."""
        return self._state.deaths

    @property
    def starts(self) -> int:
        """Workers started, replacements included."""
        return self._state.starts

    @property
    def replacement_seconds(self) -> list[float]:
        """Seconds from a kill to the replacement reporting ready, one entry per replacement."""
        return self._state.replacement_seconds


# ---------------------------------------------------------------------- outcomes


def outcome_of(raw: Any) -> Outcome:
    """What a reward returned, checked: a finite float or a :class:`RewardResult` that
    did not fail; anything else is a failure saying what came back."""
    from forgerl.types import RewardResult

    if isinstance(raw, RewardResult):
        if raw.failed:
            return None, {}, raw.error or "the reward reported a failure"
        value, subs = raw.value, dict(raw.components)
    elif isinstance(raw, numbers.Real):  # bool, int, float, numpy scalars
        value, subs = float(raw), {}
    else:
        return None, {}, f"returned {type(raw).__name__} {raw!r:.60}, expected a float or RewardResult"
    value = float(value)
    if not math.isfinite(value):
        return None, {}, f"returned {value}, expected a finite number"
    return value, {k: float(v) for k, v in subs.items()}, None


def score_one(reward: Any, sample: Any) -> Outcome:
    """Run ``reward.score`` on one sample; whatever it does, an :data:`Outcome`."""
    try:
        return outcome_of(reward.score(sample))
    except Exception as exc:  # noqa: BLE001 - any reward failure is scored, not raised
        return None, {}, f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a reward must not end the worker
        return None, {}, f"raised {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- the worker process


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies: a worker stuck in a
    reward never reads the end-of-file that tells it so."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(0)


def _build_rewards(init: dict[str, Any]) -> list[Any]:
    from forgerl.registry.plugins import build_registry

    registry = build_registry(plugins=init["plugins"])
    return [registry.require("reward", name).build(options) for name, options in init["recipes"]]


def main(argv: Sequence[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    # Ctrl-C in a terminal reaches the whole process group, and Slurm's SIGTERM (preemption,
    # requeue) every process of the step: the trainer decides when the run stops (it finishes
    # the step, checkpoints) and closes the pool; a worker must not die mid-sample on its own,
    # which would score the step's samples as failed. The pool ends workers with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent)
    conn = Connection(fd)
    try:
        init = conn.recv()
    except EOFError:
        return 0
    sys.path[:] = init["sys_path"]
    try:
        rewards = _build_rewards(init)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("error", f"building the rewards failed: {type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return 0
        if job is None:
            return 0
        index, sample = job
        conn.send(score_one(rewards[index], sample))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
