"""How the ``nccl`` transport waits for a broadcast (``groups.wait``/``groups.finished``).

gloo completes a work's future — running the callback that wakes the waiter — a moment
before the work's ``is_completed()`` turns true. A waiter that looked at
``is_completed()`` alone went back to sleep for a whole step (50 ms) after being woken:
4-6% of the chunks of a 500 MB version. The fake work below keeps ``is_completed()``
false for good once its future is done, the widest form of that gap."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from forgerl_plugins.transports.common.control import Deadline  # noqa: E402
from forgerl_plugins.transports.nccl import groups  # noqa: E402


class LaggingWork:
    """A work whose future is done while ``is_completed()`` still says False."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.waited = False

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_gloo_wait_returns_once_the_future_is_done() -> None:
    work = LaggingWork()
    done = threading.Event()

    def waiter() -> None:
        groups.wait(work, Deadline(30), completes_when_done=True)
        done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    work.future.set_result(None)  # completes it from another thread, as gloo's does
    assert done.wait(20), "groups.wait did not return after the work's future completed"
    assert work.waited, "the work's own wait() must still be called (it raises the work's error)"


def test_only_a_gloo_work_counts_its_future() -> None:
    work = LaggingWork()
    work.future.set_result(None)
    assert groups.finished(work, completes_when_done=True)
    # A NCCL work's future completes as the work is queued: it proves nothing there.
    assert not groups.finished(work, completes_when_done=False)
    with pytest.raises(TimeoutError):
        groups.wait(work, Deadline(0.2), completes_when_done=False)
