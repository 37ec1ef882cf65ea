"""A launcher's watch over its running server (vLLM, SGLang): a hung server is killed like a dead one.

A server that stops answering (SIGSTOP, a deadlocked event loop, a wedged engine) is
worse than a crashed one: its process exists, so nothing restarts it, and the requests
and weight updates sent to it wait for their own timeouts. The launcher sits beside the
server on every scheduler (local, Slurm, Kubernetes), so it is the one place that can
tell and act: when ``/health`` has not answered for ``timeout`` seconds it kills the
server's whole process tree, and exits non-zero like a crash; the scheduler restarts the
replica and the generator brings the new server to the current weights before it serves.

``/health`` answers from the server's HTTP process without touching the engine's workers
(vLLM; SGLang by default), so a long weight load or a long batch does not make a live
server look hung.
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
) -> str | None:
    """Wait for ``child`` to exit. Returns None when it exited by itself (or while we are
    ``stopping``), or why it was killed: ``probe`` (one health check with a time limit)
    failed for ``timeout`` seconds in a row."""
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
        if probe(min(PROBE_TIMEOUT, timeout)):
            last_answer = time.monotonic()
            continue
        silent = time.monotonic() - last_answer
        if silent >= timeout and child.poll() is None and not stopping():
            kill_tree(child.pid)
            child.wait()
            return f"the server (pid {child.pid}) did not answer /health for {silent:.0f} s: killed as hung"


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
