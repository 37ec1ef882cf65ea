"""Per-step metrics: metrics.jsonl (a public contract), TensorBoard, and plugin hooks."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.runs import METRICS_FILE

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    def __init__(self, run_dir: Path, hooks: Any = None, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.hooks = hooks
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")
        self._tb = _tensorboard(run_dir / "tensorboard") if tensorboard else None

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
        """TensorBoard and the ``forge_step_end`` hook, once the step is checkpointed."""
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self.hooks is not None:
            self.hooks.step_end(step=step, metrics=clean, run_dir=self.run_dir)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _tensorboard(path: Path) -> SummaryWriter | None:
    try:
        import tensorboard  # noqa: F401 - present only when the extra is installed
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))
