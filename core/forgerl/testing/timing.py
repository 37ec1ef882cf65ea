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
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def scale() -> float:
    """The factor from ``FORGE_TEST_TIMEOUT_SCALE`` (at least 1)."""
    raw = os.environ.get("FORGE_TEST_TIMEOUT_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FORGE_TEST_TIMEOUT_SCALE must be a number, got {raw!r}") from None
    return max(1.0, value)


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
