"""Driving every trainer rank from rank 0.

Trainer methods are SPMD: all ranks must call them in the same order. Rank 0 runs the
loop; the other ranks run :func:`follow`, executing whatever rank 0 broadcasts over the
default process group (which the trainer backend initialised). With one rank nothing is
broadcast.
"""

from __future__ import annotations

from typing import Any

from forgerl.interfaces import Trainer

STOP = "__stop__"


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainerDriver:
    """Rank 0's handle on the trainer of every rank."""

    def __init__(self, trainer: Trainer, world_size: int):
        self.trainer = trainer
        self.world_size = world_size

    def call(self, method: str, *args: Any) -> Any:
        if self.world_size > 1:
            _broadcast((method, args))
        return getattr(self.trainer, method)(*args)

    def stop(self) -> None:
        if self.world_size > 1:
            _broadcast((STOP, ()))


def follow(trainer: Trainer) -> None:
    """Ranks > 0: run rank 0's calls until it says stop."""
    while True:
        method, args = _broadcast(None)
        if method == STOP:
            return
        getattr(trainer, method)(*args)
