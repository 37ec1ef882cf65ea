"""Deadlines of the kits, scaled by one documented factor.

A kit waits *until* something holds, bounded by a deadline that only says when to give up;
every deadline goes through :func:`scaled`, so that one variable stretches them all on a
slow or loaded machine::

    FORGE_TEST_TIMEOUT_SCALE=3 pytest tests/

The default is 1. A deadline that passes on an idle machine but not under load means the
check measured speed, not behaviour.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


#: Beyond this a deadline is no deadline (and ``signal.alarm`` cannot hold it): a day per second.
MAX_SCALE = 86400.0


def scale() -> float:
    """The factor from ``FORGE_TEST_TIMEOUT_SCALE``: a finite number from 1 to :data:`MAX_SCALE`
    (default 1). Anything else is a ValueError saying so: a NaN, 0 or -5 once became 1
    silently, and inf overflowed later inside a test, far from the variable."""
    raw = os.environ.get("FORGE_TEST_TIMEOUT_SCALE", "").strip() or "1"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    # Written so that NaN fails it: every comparison with NaN is false.
    if not 1.0 <= value <= MAX_SCALE:
        raise ValueError(
            f"FORGE_TEST_TIMEOUT_SCALE={raw!r}: give a number from 1 to {MAX_SCALE:g} that stretches "
            "every test deadline (e.g. 3 on a loaded machine), or unset it for 1"
        )
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times the timeout factor."""
    return seconds * scale()


def wait_until(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something true (never None) and return that; fail with
    ``what`` (and how long it waited) once ``scaled(timeout)`` seconds pass."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {limit:g} s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def hard_limit(seconds: int, message: str) -> Iterator[None]:
    """Raise TimeoutError(``message``) in the main thread once ``seconds`` pass (SIGALRM),
    so that a test whose code hangs fails instead of stalling the whole run. The
    caller scales ``seconds``; the previous SIGALRM handler is put back afterwards."""

    def expire(signum: int, frame: Any) -> None:  # runs in the main thread, between bytecodes
        raise TimeoutError(message)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
