"""Driving every trainer rank from rank 0.

Trainer methods are SPMD: all ranks must call them in the same order. Rank 0 runs the
loop; the other ranks run :func:`follow`, executing whatever rank 0 broadcasts over the
default process group (which the trainer backend initialised). With one rank nothing is
broadcast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forgerl.interfaces import Trainer
from forgerl.types import TrainBatch, WeightSet

STOP = "__stop__"


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainerDriver:
    """Rank 0's handle on the trainer of every rank: each method runs the trainer method of
    the same name here and, with several ranks, on every other rank too."""

    def __init__(self, trainer: Trainer, world_size: int):
        self.trainer = trainer
        self.world_size = world_size

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._tell_others("train_step", batch)
        return self.trainer.train_step(batch)

    def export_weights(self, version: int) -> WeightSet | None:
        self._tell_others("export_weights", version)
        return self.trainer.export_weights(version)

    def save(self, path: Path) -> None:
        self._tell_others("save", path)
        self.trainer.save(path)

    def load(self, path: Path) -> None:
        self._tell_others("load", path)
        self.trainer.load(path)

    def stop(self) -> None:
        self._tell_others(STOP, None)

    def _tell_others(self, method: str, argument: Any) -> None:
        if self.world_size > 1:
            _broadcast((method, argument))


#: What rank 0 may ask of the other ranks: the trainer methods the driver has.
FOLLOWED = frozenset({"train_step", "export_weights", "save", "load"})


def follow(trainer: Trainer) -> None:
    """Ranks > 0: run rank 0's calls until it says stop."""
    while True:
        method, argument = _broadcast(None)
        if method == STOP:
            return
        if method not in FOLLOWED:
            raise RuntimeError(f"rank 0 asked for trainer.{method}, which the driver does not call")
        getattr(trainer, method)(argument)
