"""Bounds on the sizes a run config may ask for, and the check every resolved value passes.

The bounds are far above any run these machines (or a cluster) can place, and low enough
that a typo such as ``group_size: 1e12`` is refused at validation instead of allocating
gigabytes or launching thousands of processes. No pydantic here: a plugin's options module
may import a bound (``MAX_SECONDS``) without pulling in the run config's models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from forgerl.errors import ConfigError

MAX_STEPS = 10_000_000
MAX_PROMPTS_PER_STEP = 65_536
MAX_GROUP_SIZE = 1_024
MAX_SAMPLES_PER_STEP = 1_048_576
MAX_TOKENS = 1_048_576
MAX_RANKS = 65_536
MAX_REWARDS = 64
MAX_SECONDS = 7 * 24 * 3600
# numpy's legacy seeding takes 32-bit seeds; torch takes 64-bit ones.
MAX_SEED = 2**32 - 1
# Every integer in a config must fit a signed 64-bit integer (torch, numpy, C).
INT64_MAX = 2**63 - 1


def is_int(value: Any) -> TypeGuard[int]:
    """An integer that is not a bool (YAML's ``true`` is no count of anything)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_values(data: Any) -> None:
    """Every value of a resolved config, backend options included (a third-party options
    model may not refuse them itself): floats finite, integers within int64, strings
    without NUL bytes (no path or command can hold one)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: a deeply nested options block must not overflow the stack
        where, value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number (got {value})")
        elif is_int(value) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ConfigError(f"{where}: {value} does not fit a 64-bit integer")
        elif isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{where}: must not contain a NUL byte (got {value[:60]!r})")
