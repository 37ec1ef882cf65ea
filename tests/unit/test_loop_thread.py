"""forgerl.loop_thread.LoopThread: the event loop in a thread that server-backed generators
(vllm, contrib's openai) run their HTTP on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from forgerl.loop_thread import LoopThread

from ..helpers.timing import scaled


@pytest.fixture
def io():
    lt = LoopThread("test-loop-thread")
    yield lt
    lt.close()


def test_call_runs_the_coroutine_on_the_loops_thread(io):
    async def where():
        return threading.current_thread().name

    assert io.call(where(), scaled(10)) == "test-loop-thread"


def test_map_awaited_from_another_loop_keeps_the_order_of_the_items(io):
    seen = []
    done: dict[int, asyncio.Event] = {}

    async def one(x):
        seen.append(threading.current_thread().name)
        done[x] = asyncio.Event()
        if x < 3:  # each waits for the next: the last item finishes first
            while x + 1 not in done:
                await asyncio.sleep(0)
            await done[x + 1].wait()
        done[x].set()
        return x * 10

    assert asyncio.run(io.map(one, range(4))) == [0, 10, 20, 30]
    assert set(seen) == {"test-loop-thread"}


def test_when_one_fails_map_raises_it_and_cancels_the_others(io):
    cancelled = threading.Event()

    async def one(x):
        if x == 1:
            raise ValueError("request 1 failed")
        try:
            await asyncio.Event().wait()  # never set: runs until cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(ValueError, match="request 1 failed"):
        asyncio.run(io.map(one, [0, 1]))
    assert cancelled.wait(scaled(10)), "the other request still runs"


def test_cancelling_the_caller_cancels_the_coroutine_on_the_loop(io):
    started, cancelled = threading.Event(), threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def caller():
        task = asyncio.ensure_future(io.run(forever()))
        await asyncio.to_thread(started.wait, scaled(10))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(caller())
    assert cancelled.wait(scaled(10)), "the coroutine ran on after its caller was cancelled"


def test_close_runs_the_last_coroutine_ends_the_thread_and_is_idempotent():
    lt = LoopThread("test-loop-thread-close")
    ran = []

    async def last():
        ran.append(threading.current_thread().name)

    lt.close(last(), timeout=scaled(10))
    assert ran == ["test-loop-thread-close"]
    assert not any(t.name == "test-loop-thread-close" for t in threading.enumerate())
    assert lt.loop.is_closed()
    lt.close(last())  # the thread is gone: not run, and no error
    assert ran == ["test-loop-thread-close"]


def test_a_failing_last_coroutine_does_not_stop_close():
    lt = LoopThread("test-loop-thread-fail")

    async def broken():
        raise RuntimeError("the client would not close")

    lt.close(broken(), timeout=scaled(10))
    assert lt.loop.is_closed()
