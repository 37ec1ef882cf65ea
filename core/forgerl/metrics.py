"""Per-step metrics: metrics.jsonl (a public contract) and the ``forge_step_end`` hook, which
experiment trackers (TensorBoard, W&B, MLflow: forgerl_plugins.trackers) implement."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forgerl.runs import METRICS_FILE


class MetricsWriter:
    def __init__(self, run_dir: Path, hooks: Any = None, resume_step: int | None = None):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.hooks = hooks
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        """A run killed after its last checkpoint wrote rows the resumed run will write
        again; drop them so every step appears once."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:
                continue  # a torn last line from the kill
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        """:meth:`append` then :meth:`publish`."""
        self.publish(step, self.append(row))

    def append(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Add the row to metrics.jsonl (flushed); returns it as written, for :meth:`publish`.
        The loop appends a step's row before checkpointing the step, so that no kill leaves
        a checkpointed step without its row (a resume drops rows past its checkpoint)."""
        clean = {k: _jsonable(v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        return clean

    def publish(self, step: int, clean: Mapping[str, Any]) -> None:
        """The ``forge_step_end`` hook (trackers), once the step is checkpointed."""
        if self.hooks is not None:
            self.hooks.step_end(step=step, metrics=clean, run_dir=self.run_dir)

    def close(self) -> None:
        self._file.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v

