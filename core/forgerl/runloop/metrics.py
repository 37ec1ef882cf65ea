"""Per-step metrics: metrics.jsonl (a public contract) and the ``forge_step_end`` hook, which
experiment trackers (TensorBoard, W&B, MLflow: forgerl_plugins.trackers) implement.

metrics.jsonl holds whole rows only. A row is appended with unbuffered writes, and a write
that fails part-way (a full disk) is cut back to the row before, so a failure leaves no
torn row and :class:`~forgerl.errors.RunWriteError` says what to do. A file damaged some
other way (a power cut, an editor, stray bytes) is repaired on resume by :func:`repair`;
finished rows are never thrown away: damaged lines and the rows of a restarted run are set
aside in files next to it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forgerl.rundirs.diskerrors import write_failed
from forgerl.rundirs.runs import METRICS_FILE, atomic_write_text

log = logging.getLogger("forgerl.runloop.metrics")

#: Where :func:`repair` keeps the lines it could not read (appended, bytes as they were).
DAMAGED_FILE = METRICS_FILE + ".damaged"
#: Where a run trained again from step 0 keeps its earlier rows (``{n}``: 1, 2, ...).
RESTART_FILE = "metrics.before-restart-{n}.jsonl"


class MetricsWriter:
    def __init__(self, run_dir: Path, hooks: Any = None, resume_step: int | None = None):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.hooks = hooks
        self._resume = f"continue with `forge run --resume {run_dir}`"
        notes = repair(self.path, resume_step) if resume_step is not None else set_aside(run_dir)
        for note in notes:
            _tell(note, run_dir)
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise write_failed(self.path, exc, self._resume) from None

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        """:meth:`append` then :meth:`publish`."""
        self.publish(step, self.append(row))

    def append(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Add the row to metrics.jsonl (on disk when this returns); returns it as written, for
        :meth:`publish`. The loop appends a step's row before checkpointing the step, so that
        no kill leaves a checkpointed step without its row (a resume drops rows past its
        checkpoint). A row the disk refuses is not left half-written: RunWriteError."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is closed")
        clean = {k: _jsonable(v) for k, v in row.items()}
        data = (json.dumps(clean) + "\n").encode()
        start = self._size
        try:
            done = 0
            while done < len(data):
                wrote = os.write(self._fd, data[done:])
                if wrote <= 0:  # never for a regular file, but a loop must not spin on it
                    raise OSError(28, os.strerror(28), str(self.path))
                done += wrote
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)  # shrinking needs no space: the torn part goes
            except OSError:
                log.warning("could not cut the torn row off %s; it is repaired on resume", self.path)
            raise write_failed(self.path, exc, self._resume) from None
        self._size = start + len(data)
        return clean

    def publish(self, step: int, clean: Mapping[str, Any]) -> None:
        """The ``forge_step_end`` hook (trackers), once the step is checkpointed."""
        if self.hooks is not None:
            self.hooks.step_end(step=step, metrics=clean, run_dir=self.run_dir)

    def close(self) -> None:
        """Never raises: every row is already written, and the run may be ending on an error
        that this must not hide."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def read_row(line: bytes) -> dict[str, Any] | None:
    """A whole metrics row (a JSON object with a positive integer ``step``), else None."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    return row if isinstance(step, int) and not isinstance(step, bool) and step >= 1 else None


def finished_rows(path: Path) -> int:
    """How many readable rows metrics.jsonl holds (0 when it is missing or unreadable)."""
    try:
        data = path.read_bytes()
    except OSError:
        return 0
    return sum(1 for line in data.split(b"\n") if read_row(line) is not None)


def repair(path: Path, step: int) -> list[str]:
    """Make metrics.jsonl fit a run resuming at ``step``: keep the rows of steps up to it,
    drop later ones (the resumed run writes them again), and set aside every line that is
    not a whole row (a torn last line, bytes that are not UTF-8 or not JSON) in
    :data:`DAMAGED_FILE`. Returns what it did that the user should hear of (one line each)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise write_failed(path, exc, f"continue with `forge run --resume {path.parent}`") from None
    kept: list[bytes] = []
    steps: set[int] = set()
    damaged: list[bytes] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        row = read_row(line)
        if row is None:
            damaged.append(line)
        elif row["step"] <= step:
            kept.append(line)
            steps.add(row["step"])
    text = b"".join(line + b"\n" for line in kept)
    if text == data:
        return []
    resume = f"continue with `forge run --resume {path.parent}`"
    notes = []
    if damaged:
        aside = path.with_name(DAMAGED_FILE)
        try:  # the damaged lines first: once the file is rewritten they exist only here
            with open(aside, "ab") as f:
                f.write(b"".join(line + b"\n" for line in damaged))
        except OSError as exc:
            raise write_failed(aside, exc, resume) from None
        missing = [s for s in range(1, step + 1) if s not in steps]
        lost = (
            f"; no row is left for step{'s' * (len(missing) > 1)} {_ranges(missing)}, which the checkpoint "
            "holds (not trained again)"
            if missing
            else ""
        )
        notes.append(
            f"{path.name} repaired: {len(damaged)} damaged line{'s' * (len(damaged) > 1)} "
            f"({sum(len(x) for x in damaged)} bytes) set aside in {aside.name}{lost}"
        )
    try:
        atomic_write_text(path, text.decode("utf-8"))
    except OSError as exc:
        raise write_failed(path, exc, resume) from None
    return notes


def set_aside(run_dir: Path) -> list[str]:
    """A run starting at step 0 in a folder whose metrics.jsonl has rows (``--restart``, or a
    requeued job that had no checkpoint yet): move those rows to the first free
    :data:`RESTART_FILE` name instead of deleting them. Returns what it did."""
    path = run_dir / METRICS_FILE
    try:
        if path.stat().st_size == 0:
            path.unlink()
            return []
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise write_failed(path, exc, "run the command again") from None
    n = 1
    while (run_dir / RESTART_FILE.format(n=n)).exists():
        n += 1
    target = run_dir / RESTART_FILE.format(n=n)
    try:
        os.rename(path, target)  # a rename needs no free space
    except OSError as exc:
        raise write_failed(target, exc, "run the command again") from None
    rows = finished_rows(target)
    return [f"training again from step 0; the {rows} earlier row{'s' * (rows != 1)} of {METRICS_FILE} "
            f"are kept in {target.name}"]


def _tell(note: str, run_dir: Path) -> None:
    from forgerl import events

    log.warning("%s", note)
    events.announce(note, stage="loop", state="warning", run_dir=run_dir)


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][-1] + 1:
            spans[-1].append(s)
        else:
            spans.append([s])
    return ", ".join(str(x[0]) if len(x) == 1 else f"{x[0]}-{x[-1]}" for x in spans)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
