"""Holding out a fraction of a task's problems for evaluation, the same ones every run."""

from __future__ import annotations

import math
import random

from forgerl.errors import ConfigError
from forgerl.types import Problem


def hold_out(
    problems: list[Problem], fraction: float, rng_key: str, too_few: str
) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): ``floor(n * fraction)`` problems (at least 1) drawn by a generator
    seeded with ``rng_key``, so a task's split never moves between runs. ``too_few``, given
    the row count, is the one-line error when nothing would be left to train on."""
    if fraction <= 0:
        return problems, []
    n = len(problems)
    k = max(1, math.floor(n * fraction))
    if n - k < 1:
        raise ConfigError(too_few.format(n=n, fraction=fraction))
    order = list(range(n))
    random.Random(rng_key).shuffle(order)
    held = set(order[:k])
    return [p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held]
