"""The ``wandb`` tracker: every step's metrics, and the run's config, to Weights & Biases.
Off unless ``logging.wandb.enabled``. ``logging.wandb.mode: offline`` (the default) needs no
network or account: the run is written to ``<run_dir>/wandb`` and ``wandb sync`` uploads it
later; ``online`` uploads as the run goes, after ``wandb login``. A resumed run continues
the same W&B run (its id comes from the run directory)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forgerl_plugins.trackers.common import SAMPLE_COLUMNS, Tracker, sample_rows

LOG_DIR = "wandb"
#: The history key of each step's samples table (not "samples": the metrics samples/* are there).
SAMPLES_KEY = "samples_table"


def run_id(run_dir: Path) -> str:
    """One W&B run per run directory, whatever the number of resumes."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class WandB(Tracker):
    name = "wandb"
    module = "wandb"
    install = "pip install wandb"
    switch = "set logging.wandb.enabled=false"

    def enabled(self, config: Any) -> bool:
        return bool(config.logging.wandb.enabled)

    def open(self, config: Any, run_dir: Path) -> Any:
        import wandb

        options = config.logging.wandb
        return wandb.init(
            project=options.project,
            name=run_dir.name,
            id=run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            mode=options.mode,
            config=json.loads(config.model_dump_json()),
            # The trainer's log is the run's own; W&B need not capture it.
            settings=wandb.Settings(console="off", silent=True),
        )

    def where(self, run_dir: Path) -> str:
        return f"writing {run_dir / LOG_DIR}"

    def write(self, handle: Any, step: int, values: dict[str, float]) -> None:
        handle.log(values, step=step)

    def write_samples(self, handle: Any, step: int, samples: Sequence[Any]) -> None:
        import wandb

        # At the step of the metrics just logged: the table joins that step's history row.
        handle.log({SAMPLES_KEY: wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(samples))}, step=step)

    def close(self, handle: Any, summary: Mapping[str, Any]) -> None:
        for key in ("eval_accuracy_start", "eval_accuracy_end", "status"):
            if summary.get(key) is not None:
                handle.summary[key] = summary[key]
        handle.finish(exit_code=0 if summary.get("status") == "completed" else 1)
        import wandb

        # finish() can return before wandb's service has written the run file (seen with
        # wandb 0.31 on a process's first run), and a worker leaves with os._exit: stop
        # the service here, which waits until it has written everything.
        wandb.teardown()


_tracker = WandB()

forge_run_start, forge_step_end, forge_run_end = _tracker.run_hooks()
forge_step_samples = _tracker.forge_step_samples
