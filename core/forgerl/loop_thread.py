"""An asyncio event loop of its own, in a thread: for generators that talk to servers.

A generator's ``generate`` is awaited from more than one event loop (the rollout thread's,
``asyncio.run`` in evaluation: docs/plugins-generator.md) while ``update_weights`` and
``close`` are plain calls from other threads. An async HTTP client (httpx, aiohttp) and
the asyncio primitives around it (semaphores, locks) belong to the loop that made them.
Running all of them on one loop in a thread of the generator gives every caller one
connection pool and one view of the servers::

    self._io = LoopThread("forge-mygen-http")
    self._io.call(self._connect())                      # from a plain method

    async def generate(self, requests):                 # from any event loop
        return await self._io.map(self._one, requests)

    def close(self):
        self._io.close(self._client.aclose())
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class LoopThread:
    """``LoopThread(name)``: a new event loop, run forever by a daemon thread called ``name``
    until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result here (a thread that runs no
        event loop, or one that may block). Raises TimeoutError after ``timeout`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await`` ``coro`` run on this loop from another event loop. Cancelling the
        caller (``asyncio.wait_for`` running out, say) cancels ``coro`` too."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def map(self, fn: Callable[[T], Awaitable[R]], items: Iterable[T]) -> list[R]:
        """``[await fn(item) for item in items]``, all at once on this loop, awaited from
        another one; results in the order of ``items``. When one fails, the others are
        cancelled (their requests stop too) and its error is raised."""
        return await self.run(_all(fn, list(items)))

    def close(self, last: Coroutine[Any, Any, Any] | None = None, timeout: float = 10.0) -> None:
        """Run ``last`` (closing a client, say; at most ``timeout`` seconds, its errors
        logged), stop the loop and end the thread. Idempotent."""
        if self._thread.is_alive():
            if last is not None:
                try:
                    self.call(last, timeout)
                except Exception:  # closing anyway
                    log.debug("%s: the last coroutine before closing failed", self._thread.name, exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        elif last is not None:
            last.close()  # never run: no "coroutine was never awaited" warning
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


async def _all(fn: Callable[[T], Awaitable[R]], items: list[T]) -> list[R]:
    tasks = [asyncio.ensure_future(fn(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
