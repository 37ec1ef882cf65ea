"""A launcher's watch over its running server (vLLM, SGLang): a hung server is killed like a dead one.

A server that stops answering (SIGSTOP, a deadlocked event loop, a wedged engine) is
worse than a crashed one: its process exists, so nothing restarts it, and the requests
and weight updates sent to it wait for their own timeouts. The launcher sits beside the
server on every scheduler (local, Slurm, Kubernetes), so it is the one place that can
tell and act: when its probe has not succeeded for ``timeout`` seconds it kills the
server's whole process tree, and exits non-zero like a crash; the scheduler restarts the
replica and the generator brings the new server to the current weights before it serves.

The probe goes through the engine, not only the HTTP server: vLLM's ``/health`` answers
from its API server process even while the engine core and its workers are stuck (a hung
NCCL or CUDA call, SIGSTOP), so a replica whose every request would time out looked
healthy forever. An engine probe is the engine's own (``ServerPlan.engine_probe``): the
engine made progress since the last probe, or a one-token generation answered within the
probe's deadline; a long batch therefore counts as alive. An engine that the generator
paused for a weight load answers nothing until it resumes: while the generator's notice of
that update is fresh (:mod:`forgerl_plugins.generators.common.update_notice`, which the
generators' launchers read) its silence is excused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

#: Longest wait for one probe: a slow answer on a loaded machine is still an answer.
PROBE_TIMEOUT = 10.0


def watch(
    child: subprocess.Popen,
    probe: Callable[[float], bool],
    *,
    interval: float,
    timeout: float,
    stopping: Callable[[], bool] = lambda: False,
    excused: Callable[[], bool] = lambda: False,
    what: str = "/health",
) -> str | None:
    """Wait for ``child`` to exit. Returns None when it exited by itself (or while we are
    ``stopping``), or why it was killed: ``probe`` (one check with a time limit, ``what``
    in the message) failed for ``timeout`` seconds in a row, none of them ``excused``
    (the generator paused the engine for a weight update)."""
    last_answer = time.monotonic()
    while True:
        try:
            child.wait(timeout=interval)
            return None
        except subprocess.TimeoutExpired:
            pass
        if stopping():
            child.wait()
            return None
        if excused():
            # Not probed while paused (a probe would only queue behind the load); silence
            # counts from the end of the update, so the engine then has the whole timeout.
            last_answer = time.monotonic()
            continue
        if probe(min(PROBE_TIMEOUT, timeout)):
            last_answer = time.monotonic()
            continue
        if excused():  # the pause began while the probe waited
            last_answer = time.monotonic()
            continue
        silent = time.monotonic() - last_answer
        if silent >= timeout and child.poll() is None and not stopping():
            kill_tree(child.pid)
            child.wait()
            return f"the server (pid {child.pid}) did not answer {what} for {silent:.0f} s: killed as hung"


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. The tree is read before anything is
    killed, so orphans re-parented to init mid-way are not missed; SIGKILL also ends
    stopped processes."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found
