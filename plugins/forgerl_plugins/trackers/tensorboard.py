"""The ``tensorboard`` tracker: every step's metrics as TensorBoard scalars in
``<run_dir>/tensorboard`` (``tensorboard --logdir runs/``). On unless
``logging.tensorboard: false``; scripts/setup.sh installs it (the ``tensorboard`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forgerl_plugins.trackers.common import Tracker

LOG_DIR = "tensorboard"


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

    def close(self, handle: Any, summary: Mapping[str, Any]) -> None:
        handle.close()


_tracker = TensorBoard()

forge_run_start, forge_step_end, forge_run_end = _tracker.run_hooks()
