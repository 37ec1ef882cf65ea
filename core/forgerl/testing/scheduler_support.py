"""What the scheduler kit's jobs are made of: one short Python program that every role of
every test job runs, and what the kit reads back from it (which processes it started, on
which host) to tell whether anything is left running.

A role runs ``python -c ROLE_PROGRAM MODE RUN_DIR NAME SECONDS``. It first writes
``RUN_DIR/NAME.json`` (its host name and the pid and start time of itself and, in mode
``forever``, of a child it started: a process tree for the scheduler to end), prints
``forge-kit: NAME started``, then by ``MODE``:

- ``gate``: waits until ``RUN_DIR/go`` exists, prints ``forge-kit: NAME done``, exits 0;
- ``fail``: prints ``forge-kit: NAME fails with exit status 3``, exits 3;
- ``forever``: runs until something stops it.

Every mode gives up after ``SECONDS`` (exit 1), so a scheduler that fails to stop a role
leaves nothing behind for long. The program needs only the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any, TypeGuard

#: The message a role prints when its gate opened (``gate``), or when it fails (``fail``).
DONE = "forge-kit: {name} done"
FAILS = "forge-kit: {name} fails with exit status 3"
STARTED = "forge-kit: {name} started"

ROLE_PROGRAM = r"""
import json, os, socket, subprocess, sys, time
from pathlib import Path

mode, run_dir, name, seconds = sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
deadline = time.monotonic() + seconds


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2:].split()[19]
    except OSError:
        return ""


pids = [os.getpid()]
if mode == "forever":
    # A child of the role, as a server's workers: stopping the role must stop its tree.
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    pids.append(child.pid)
record = {"host": socket.gethostname(), "processes": [[pid, start_time(pid)] for pid in pids]}
tmp = run_dir / f".{name}.json.tmp"
tmp.write_text(json.dumps(record))
os.replace(tmp, run_dir / f"{name}.json")
print(f"forge-kit: {name} started", flush=True)
if mode == "fail":
    print(f"forge-kit: {name} fails with exit status 3", flush=True)
    sys.exit(3)
while time.monotonic() < deadline:
    if mode == "gate" and (run_dir / "go").exists():
        print(f"forge-kit: {name} done", flush=True)
        sys.exit(0)
    time.sleep(0.05)
print(f"forge-kit: {name} gave up after {seconds:g} s", flush=True)
sys.exit(1)
"""


def role_command(python: str, mode: str, run_dir: str, name: str, seconds: float) -> tuple[str, ...]:
    return (python, "-c", ROLE_PROGRAM, mode, run_dir, name, f"{seconds:g}")


def read_record(run_dir: Path, name: str) -> dict[str, Any] | None:
    """What role ``name`` wrote when it started, or None before it did."""
    try:
        return json.loads((run_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _start_time(pid: int) -> str | None:
    """The start time of a live (not zombie) process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def on_this_host(record: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Whether the role ran on this machine, so that its processes can be looked up here."""
    return record is not None and record.get("host") == socket.gethostname() and os.path.isdir("/proc")


def still_running(record: dict[str, Any] | None) -> list[int]:
    """Pids of the role's processes still running here (the same process: same start time)."""
    if not on_this_host(record):
        return []
    return [pid for pid, start in record["processes"] if start and _start_time(pid) == start]


def kill_leftovers(record: dict[str, Any] | None) -> None:
    """SIGKILL what a role started and a broken scheduler left running (by pid and start
    time, never by name), so that a failed check leaves nothing behind."""
    for pid in still_running(record):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
