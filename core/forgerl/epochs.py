"""Epochs over a fixed list of training items (a file task's problems, supervised
demonstrations): each epoch a fresh shuffle that depends on the run's seed and the epoch
only, so a resumed run takes the same items in the same order as one that never stopped."""

from __future__ import annotations

import random


class EpochCursor:
    """Where a task is in its epochs over ``size`` problems; ``salt`` keeps two tasks with
    the same seed from sharing an order."""

    def __init__(self, size: int, seed: int, salt: str):
        self.size, self.seed, self.salt = size, seed, salt
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def take(self, n: int) -> list[int]:
        """The indices of the next ``n`` problems, into the next epoch when one runs out."""
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._shuffled(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def restore(self, epoch: int, position: int) -> None:
        self.epoch, self.position = int(epoch), int(position)
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(f"{self.salt}:{self.seed}:{epoch}").shuffle(order)
        return order
