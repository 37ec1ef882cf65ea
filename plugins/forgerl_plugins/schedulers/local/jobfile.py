"""The files of a local job, and what each process is given.

Layout of ``<run_dir>`` (the job id of a local job is this directory's absolute path):

``job.json``
    The job's record, rewritten atomically at every change: name, supervising pid, state,
    exit code, detail, and one entry per process (role, replica, rank, pid, pgid, log,
    command, exit code, restarts). ``forge status|logs|cancel`` in another process read it.
``logs/<role>-<replica>.log``
    stdout and stderr of a single-rank replica; ``logs/<role>-<replica>.rank<r>.log`` for
    each rank of a multi-rank one. Restarts append to the same file after a marker line.
``logs/scheduler.log``
    The job's event log: starts, exits, restarts, stops, the outcome.
``cancel-requested``
    Written by ``cancel`` from any process; the supervisor treats it as "stop and cancel".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forgerl.errors import JobNotFound
from forgerl.rundirs.diskerrors import write_failed
from forgerl.rundirs.runs import append_line
from forgerl.types import JobSpec, RoleSpec

JOB_FILE = "job.json"
CANCEL_FILE = "cancel-requested"
EVENT_LOG = "scheduler.log"
FORMAT_VERSION = 1


def log_name(role: str, replica: int, rank: int, ranks_per_replica: int) -> str:
    suffix = f".rank{rank}" if ranks_per_replica > 1 else ""
    return f"{role}-{replica}{suffix}.log"


def process_env(
    job: JobSpec,
    role: RoleSpec,
    replica: int,
    rank: int,
    run_dir: Path,
    master_addr: str,
    master_port: int | str,
) -> dict[str, str]:
    """The variables forge sets for one process (the rest of its environment is inherited).

    Precedence: the supervisor's environment < ``job.env`` < ``role.env`` < forge's own
    variables, which must be right for the rendezvous to work. Every process, single-rank
    ones included, gets the torch.distributed variables so code can rely on them.
    """
    env = {str(k): str(v) for k, v in job.env.items()}
    env.update({str(k): str(v) for k, v in role.env.items()})
    # Block-buffered stdout would make `forge logs` lag behind a Python process by kilobytes.
    env.setdefault("PYTHONUNBUFFERED", os.environ.get("PYTHONUNBUFFERED", "1"))
    env.update(
        FORGE_ROLE=role.name,
        FORGE_REPLICA=str(replica),
        FORGE_RUN_DIR=str(run_dir),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(role.ranks_per_replica),
        LOCAL_WORLD_SIZE=str(role.ranks_per_replica),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    return env


def resolve_job_dir(job_id: str) -> Path:
    """The run directory a job id names; JobNotFound when it holds no local job."""
    run_dir = Path(job_id).expanduser().resolve()
    if not (run_dir / JOB_FILE).is_file():
        raise JobNotFound(
            f"no local job {job_id!r}: {run_dir / JOB_FILE} does not exist "
            "(a local job's id is its run directory)"
        )
    return run_dir


def read_job(run_dir: Path) -> dict[str, Any]:
    path = run_dir / JOB_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JobNotFound(f"no local job at {run_dir}: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise JobNotFound(f"cannot read local job {run_dir}: {path}: {e}") from None


def write_job(run_dir: Path, record: Mapping[str, Any]) -> bool:
    """Atomic: a reader in another process sees the old record or the new one, never half.

    A disk that refuses the write (full, read-only) must not end the supervisor, which
    would leave the job's processes unsupervised: the old record stays, the temporary file
    goes, and False says so (the next write tries again)."""
    path = run_dir / JOB_FILE
    tmp = path.with_name(f".{JOB_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False
    return True


def log_event(run_dir: Path, message: str) -> None:
    """One line in logs/scheduler.log; a full disk drops the line rather than stopping the
    supervisor (:func:`forgerl.rundirs.runs.append_line`)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    append_line(run_dir / "logs" / EVENT_LOG, f"{stamp} {message}\n".encode())


def request_cancel(run_dir: Path) -> None:
    path = run_dir / CANCEL_FILE
    try:
        path.write_text(f"pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    except OSError as exc:
        try:
            path.unlink()
        except OSError:
            pass
        raise write_failed(path, exc, "cancel again, or stop the job's processes yourself") from None


def cancel_requested(run_dir: Path) -> bool:
    return (run_dir / CANCEL_FILE).exists()


def clear_cancel(run_dir: Path) -> None:
    try:
        (run_dir / CANCEL_FILE).unlink()
    except FileNotFoundError:
        pass


def last_line(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log (the error message, usually), shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= limit else line[: limit - 3] + "..."
