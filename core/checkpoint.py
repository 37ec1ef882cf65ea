"""Checkpoints of a run: trainer state (the trainer's own format, e.g. DCP) plus loop state.

Layout: ``<run_dir>/checkpoints/step-000010/{trainer/, loop.json, rollouts.pt}`` and a
``latest`` file naming the newest complete one. A checkpoint is built under a temporary
name and renamed into place before ``latest`` moves, so a crash while saving leaves the
previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from forgerl.errors import CheckpointError

LOOP_STATE = "loop.json"
ROLLOUTS = "rollouts.pkl"
LATEST = "latest"


def root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f".tmp-step-{step:06d}"


def final_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f"step-{step:06d}"


def prepare(run_dir: Path, step: int) -> Path:
    """A fresh staging directory for the checkpoint of ``step`` (rank 0 only)."""
    tmp = staging_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "trainer").mkdir(parents=True)
    return tmp


def commit(run_dir: Path, step: int, loop_state: dict[str, Any], rollouts: Any, keep: int) -> Path:
    """Write the loop state into the staging dir, move it into place, point ``latest``
    at it and delete the oldest beyond ``keep``."""
    tmp = staging_dir(run_dir, step)
    with open(tmp / ROLLOUTS, "wb") as f:
        pickle.dump(rollouts, f, protocol=pickle.HIGHEST_PROTOCOL)
    # loop.json last: its presence marks the folder complete.
    (tmp / LOOP_STATE).write_text(json.dumps(loop_state))
    _fsync_dir(tmp)
    final = final_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root(run_dir) / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root(run_dir) / LATEST)
    _fsync_dir(root(run_dir))
    _prune(run_dir, keep)
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    try:
        name = (root(run_dir) / LATEST).read_text().strip()
    except OSError:
        return None
    path = root(run_dir) / name
    if not (path / LOOP_STATE).is_file():
        raise CheckpointError(f"checkpoint {path} named by {root(run_dir) / LATEST} is incomplete")
    return path


def load_loop_state(path: Path) -> tuple[dict[str, Any], Any]:
    state = json.loads((path / LOOP_STATE).read_text())
    with open(path / ROLLOUTS, "rb") as f:
        rollouts = pickle.load(f)
    return state, rollouts


def clean_staging(run_dir: Path) -> None:
    """Remove half-written checkpoints left by a crash."""
    for tmp in root(run_dir).glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(run_dir: Path, keep: int) -> None:
    done = sorted(p for p in root(run_dir).glob("step-*") if (p / LOOP_STATE).is_file())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
