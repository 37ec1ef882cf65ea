"""What ``forge run --resume DIR`` and ``--restart DIR`` check before anything starts.

A resume must continue the run's history, never replace it: without a checkpoint it would
train again from step 0 over finished rows, and with fewer steps than its checkpoint holds
it would do nothing while config.yaml claimed otherwise. Both are one line saying what to
do instead; ``--restart`` is the explicit way to train again from step 0, and it keeps the
earlier rows (:func:`forgerl.runloop.metrics.set_aside`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.checkpoints import checkpoint
from forgerl.errors import ConfigError, ResumeError
from forgerl.rundirs import runs
from forgerl.runloop import metrics

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig


def trained_steps(run_dir: Path) -> int | None:
    """The step of the run's newest checkpoint folder (by name; usable or not), or None."""
    found = checkpoint.checkpoints(run_dir)
    return int(found[0].name.split("-")[1]) if found else None


def check(run_dir: Path, config: RunConfig, *, restart: bool) -> None:
    """Raise one line when resuming (or restarting) ``run_dir`` with ``config`` would lose
    or contradict what the run has done."""
    trained = trained_steps(run_dir)
    folder = checkpoint.root(run_dir)
    if restart:
        if trained is not None:
            raise ResumeError(
                f"--restart {run_dir}: it has checkpoints (the newest is of step {trained}); continue it with "
                f"`forge run --resume {run_dir}`, or move {folder} away to train again from step 0"
            )
        return
    if trained is None:
        rows = metrics.finished_rows(run_dir / runs.METRICS_FILE)
        if rows:
            raise ResumeError(
                f"--resume {run_dir}: no checkpoint to resume from ({folder} holds none), but "
                f"{runs.METRICS_FILE} has {rows} finished step{'s' * (rows != 1)}; to train again from step 0 "
                f"in this directory, keeping those rows aside, use `forge run --restart {run_dir}`"
            )
        return
    steps = config.loop.steps
    if steps < trained:
        raise ConfigError(
            f"--resume {run_dir}: loop.steps {steps} is below the {trained} steps its checkpoint has "
            f"trained; give --steps {trained} or more, or leave --steps out"
        )


def set_aside_history(run_dir: Path) -> list[str]:
    """``--restart``: the run's finished rows move aside before its job starts (so that
    ``forge run``'s progress counts the new rows from step 1). Returns what was done."""
    return metrics.set_aside(run_dir)
