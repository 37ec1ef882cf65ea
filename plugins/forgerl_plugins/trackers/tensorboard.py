"""The ``tensorboard`` tracker: every step's metrics as TensorBoard scalars in
``<run_dir>/tensorboard`` (``tensorboard --logdir runs/``), and a few of each step's
sample records as a markdown table in its Text tab. On unless ``logging.tensorboard:
false``; scripts/setup.sh installs it (the ``tensorboard`` extra)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forgerl_plugins.trackers.common import Tracker

LOG_DIR = "tensorboard"
#: The text summary a step's samples go to (TensorBoard's Text tab).
SAMPLES_TAG = "samples"
#: Records in a step's table (the lowest and the highest rewards, half each), and the
#: characters of one cell: an event file grows by a few KiB a step, not by the step's records.
MAX_ROWS = 8
MAX_CELL = 400
COLUMNS = ("kind", "group", "index", "problem_id", "reward", "advantage", "correct", "finish_reason", "error",
           "completion")
#: What markdown would read as structure in a table cell: backslash-escaped (markdown's own escapes).
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+\-.!|])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class TensorBoard(Tracker):
    name = "tensorboard"
    module = "tensorboard"
    install = "pip install 'forgerl[tensorboard]'"
    switch = "set logging.tensorboard=false to silence this"

    def enabled(self, config: Any) -> bool:
        return bool(config.logging.tensorboard)

    def open(self, config: Any, run_dir: Path) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(run_dir / LOG_DIR))

    def where(self, run_dir: Path) -> str:
        return f"writing {run_dir / LOG_DIR} (tensorboard --logdir {run_dir.parent})"

    def write(self, handle: Any, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            handle.add_scalar(key, value, step)
        handle.flush()

    def write_samples(self, handle: Any, step: int, samples: Sequence[Any]) -> None:
        handle.add_text(SAMPLES_TAG, samples_markdown(samples, step), step)
        handle.flush()

    def close(self, handle: Any, summary: Mapping[str, Any]) -> None:
        handle.close()


def samples_markdown(samples: Sequence[Any], step: int) -> str:
    """A step's records as a markdown table: all of them up to :data:`MAX_ROWS`, else the
    lowest and the highest rewards (in the order written), each text cut to
    :data:`MAX_CELL` characters. What a model wrote is data: every character markdown or
    HTML would read as structure is escaped, line breaks are shown as ``<br>``."""
    chosen = list(range(len(samples)))
    if len(chosen) > MAX_ROWS:
        ranked = sorted(chosen, key=lambda i: -math.inf if samples[i].reward is None else samples[i].reward)
        low = MAX_ROWS // 2
        chosen = sorted(ranked[:low] + ranked[len(ranked) - (MAX_ROWS - low):])
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for i in chosen:
        r = samples[i]
        lines.append("| " + " | ".join(_cell(getattr(r, c, None)) for c in COLUMNS) + " |")
    note = f"{len(chosen)} of {len(samples)} samples of step {step}" + (
        " (the lowest and highest rewards)" if len(chosen) < len(samples) else "") + "; "
    return "\n".join(lines) + "\n\n" + _cell(note + f"all of them: forge samples RUN_DIR --step {step}")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if len(text) > MAX_CELL:
        text = text[: MAX_CELL - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MARKDOWN.sub(r"\\\1", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
    return _CONTROL.sub(" ", text)


_tracker = TensorBoard()

forge_run_start, forge_step_end, forge_run_end = _tracker.run_hooks()
forge_step_samples = _tracker.forge_step_samples
