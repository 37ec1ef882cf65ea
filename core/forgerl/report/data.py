"""What `forge report` reads from a run directory: metrics rows, config, status, series.

Nothing here imports matplotlib: the series are plain lists, tested against metrics.jsonl,
and the same lists are what the plots draw and what the HTML keeps as data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError, UserError
from forgerl.rundirs import runs


class NotARun(UserError):
    """A path given to `forge report` is not a run directory with metrics."""


@dataclass
class RunData:
    run_dir: Path
    label: str
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    #: Lines of metrics.jsonl that could not be read (a row being written right now).
    unreadable_lines: int = 0

    @property
    def status(self) -> str:
        """``completed``, ``failed`` or ``interrupted`` from summary.json; a run without
        one is still going (or was killed before it could write one)."""
        if self.summary and self.summary.get("status"):
            return str(self.summary["status"])
        return "running (no summary.json yet)"

    @property
    def planned_steps(self) -> int | None:
        steps = self.config.get("loop", {}).get("steps")
        return int(steps) if isinstance(steps, int) else None


def read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics.jsonl and how many lines were not JSON objects. A running
    run may be half-way through writing its last line; a killed one may have left it
    torn. Both are skipped, never fatal."""
    rows: list[dict[str, Any]] = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def load_run(path: str | Path, label: str | None = None) -> RunData:
    """Read one run directory; a path that is not one (or has no rows yet) is a
    :class:`NotARun` with one line saying which."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise NotARun(f"{str(path)!r} is not a directory: give a run directory (e.g. runs/20250101-120000)")
    metrics = run_dir / runs.METRICS_FILE
    if not metrics.is_file():
        what = "a run directory whose run has not finished a step yet" if (run_dir / runs.CONFIG_FILE).is_file() \
            else "not a run directory"
        raise NotARun(f"{str(path)!r} has no {runs.METRICS_FILE}: {what}")
    try:
        rows, bad = read_rows(metrics)
    except OSError as exc:
        raise NotARun(f"cannot read {metrics}: {exc.strerror}") from None
    if not rows:
        raise NotARun(f"{metrics} has no complete rows yet: the run has not finished a step")
    return RunData(
        run_dir=run_dir,
        label=label or run_dir.resolve().name,
        rows=rows,
        config=_read_config(run_dir / runs.CONFIG_FILE),
        summary=_read_json(run_dir / runs.SUMMARY_FILE),
        unreadable_lines=bad,
    )


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    from forgerl.configuration.sources import load_yaml

    try:
        # The config loader's rules: a run directory from elsewhere may hold an alias bomb.
        loaded = load_yaml(path.read_text())
    except (OSError, ValueError, RecursionError, yaml.YAMLError, ConfigError):
        return {}  # missing or malformed: only the config table is lost
    return loaded if isinstance(loaded, dict) else {}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


# --------------------------------------------------------------------------- series


def number(value: Any) -> float | None:
    """A finite number, else None (metrics.jsonl writes a non-finite value as null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def wall_seconds(rows: list[dict[str, Any]]) -> tuple[list[float], str]:
    """Seconds since the first step began, per row, and what they are. Rows carry
    ``time/wall`` (the end of the step); the first step began ``time/step`` before its end.
    Runs written before ``time/wall`` existed fall back to the running sum of ``time/step``
    (which leaves out evaluation and checkpoints)."""
    walls = [w for w in (number(r.get("time/wall")) for r in rows) if w is not None]
    if rows and len(walls) == len(rows):
        start = walls[0] - (number(rows[0].get("time/step")) or 0.0)
        return [w - start for w in walls], "wall-clock seconds since the first step began"
    total, out = 0.0, []
    for r in rows:
        total += number(r.get("time/step")) or 0.0
        out.append(total)
    return out, "seconds of training steps (sum of time/step; this run's rows have no time/wall)"


@dataclass
class Series:
    key: str
    steps: list[float]
    walls: list[float]
    values: list[float]


def series(run: RunData, key: str) -> Series:
    """The points of one metric: every row that has a finite value for it (evaluation
    keys appear on evaluating steps only)."""
    walls, _ = wall_seconds(run.rows)
    steps, ws, values = [], [], []
    for row, wall in zip(run.rows, walls):
        v = number(row.get(key))
        if v is None:
            continue
        steps.append(float(row["step"]))
        ws.append(wall)
        values.append(v)
    return Series(key, steps, ws, values)


def keys_present(runs_: list[RunData]) -> set[str]:
    return {k for run in runs_ for row in run.rows for k, v in row.items() if number(v) is not None}


# ---------------------------------------------------------------------- config table


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"loop": {"steps": 3}}`` -> ``{"loop.steps": 3}``; lists by index, as ``--set``
    names them (``rewards.0.name``)."""
    out: dict[str, Any] = {}
    items: Iterable[tuple[Any, Any]]
    if isinstance(config, dict):
        items = config.items()
    elif isinstance(config, list):
        items = ((str(i), v) for i, v in enumerate(config))
    else:
        return {prefix: config}
    empty = True
    for k, v in items:
        empty = False
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    if empty and prefix:
        out[prefix] = config
    return out


#: Never a difference worth a row: every run has its own.
_IGNORED_CONFIG_KEYS = {"output"}


def config_differences(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """``(dotted key, value per config)`` for every key whose value is not the same in
    all configs (a key one config lacks counts as different, its value ``None``)."""
    flat = [flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f} - _IGNORED_CONFIG_KEYS)
    rows = []
    for k in keys:
        values = [f.get(k) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append((k, values))
    return rows


def default_config() -> dict[str, Any]:
    """The config `forge run` would use with no file and no flags, backend options
    resolved, as a dict (what a single run's config is compared with)."""
    from forgerl import api

    return json.loads(api.load_config().model_dump_json())
