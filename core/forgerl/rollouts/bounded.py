"""Environment calls on worker threads, each under a deadline.

Why threads and not processes: an environment is a Python object holding its
trajectory's state between calls; a process per trajectory would pickle that state or
keep a process alive per trajectory (thousands per step at scale), and most environments
are cheap Python. What a thread cannot do is be killed: a call past its deadline is
abandoned (its daemon thread is left to finish or hang; it holds no lock of ours) and
its trajectory fails. Tools that run model-written code belong in the ``code`` reward's
sandbox, which kills processes. The count of abandoned threads is a metric
(``env/abandoned_threads``) so a leaking environment shows.

A fresh thread per call, not a pool: a hung call must not take a pool worker from the
other trajectories (a pool of N hangs after N hung calls).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CallTimeout(Exception):
    """An environment call ran past its deadline."""


_abandoned = 0
_abandoned_lock = threading.Lock()


def abandoned_threads() -> int:
    """Calls abandoned past their deadline that have not returned yet."""
    return _abandoned


async def call_bounded(fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
    """``fn(*args)`` on a new daemon thread; its result, or its exception re-raised, or
    CallTimeout after ``timeout`` seconds. The event loop never blocks on ``fn``. A call
    past its deadline, or whose caller is cancelled, is abandoned (and counted)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    state = {"abandoned": False, "returned": False}

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        global _abandoned
        result: Any
        try:
            result, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, ok = exc, False
        with _abandoned_lock:
            state["returned"] = True
            if state["abandoned"]:
                _abandoned -= 1
                return
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    def abandon() -> None:
        global _abandoned
        with _abandoned_lock:
            if not state["returned"] and not state["abandoned"]:  # one that returned just now is not left behind
                state["abandoned"] = True
                _abandoned += 1

    threading.Thread(target=target, name=f"forge-env-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except asyncio.TimeoutError:
        abandon()
        raise CallTimeout(f"{what} did not return within {timeout:g} s") from None
    except asyncio.CancelledError:
        abandon()  # the caller gave up on it (an agent's episode deadline): left behind too
        raise
