"""Private two-party process groups, built beside (never through) torch.distributed's
default group.

The trainer already uses the default group for FSDP, and a vLLM worker has its own; a
transport must not touch either. So a group here is a bare ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (GPU) constructed on a ``PrefixStore`` of the transport's control
store, with group-local ranks, and used through its own methods (``pg.broadcast``), not
through ``torch.distributed.broadcast``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from forgerl_plugins.transports.common.control import Backoff, timedelta

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.transports.nccl.options import Options

log = logging.getLogger(__name__)

_ENV_LOCK = threading.Lock()


def resolve_backend(backend: str) -> str:
    """``auto`` → ``nccl`` where CUDA is available, else ``gloo``."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def local_preflight(options: Options) -> None:
    """Before ``forge run`` starts anything on this machine: an explicit ``backend: nccl``
    (or gloo) can form a group here. Without it, vLLM started and the run failed 155 s
    later on the transport's connect timeout."""
    if options.backend == "auto":
        return  # nccl only where CUDA is, else gloo: always formable
    from forgerl.errors import ConfigError
    from forgerl_plugins.torch_dist import backend_problem

    problem = backend_problem(options.backend)
    if problem:
        raise ConfigError(
            f"transport.options.backend is {options.backend!r}, but {problem}; use 'auto' (NCCL on GPUs, "
            "gloo on CPUs) or 'gloo'"
        )


def device_for(backend: str) -> Any:
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_group(store: Any, rank: int, size: int, backend: str, timeout: float, address: str) -> Any:
    """Construct the group; blocks until all ``size`` ranks have joined (or ``timeout``)."""
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
        opts._timeout = timedelta(timeout)
        # The address peers use to reach this process: loopback stays on loopback.
        opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
        # Each gloo op starts with a handshake between the two sides; with more ops in
        # flight (one per thread) a handshake overlaps the previous chunk's bytes. 4 beat
        # the default 2 by about 10% for 50-chunk versions on two busy cores.
        opts._threads = 4
        return ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timedelta(timeout)
        # NCCL's watchdog would take the whole process down on a timeout (the default
        # error handling); a generator must survive a dead trainer, so this group only
        # aborts its communicator. The variable is read when the group is constructed.
        with _ENV_LOCK:
            saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            try:
                return ProcessGroupNCCL(store, rank, size, opts)
            finally:
                if saved is None:
                    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    raise ValueError(f"unknown process-group backend {backend!r} (gloo or nccl)")


def broadcast(pg: Any, tensor: Any, root: int, timeout: float) -> Any:
    """Start a broadcast of ``tensor`` from group rank ``root``; returns the Work."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = timedelta(timeout)
    return pg.broadcast([tensor], opts)


def on_done(work: Any, wake: threading.Event) -> None:
    """Set ``wake`` when ``work``'s future completes (or fails), from the backend's own
    thread. Waiting on the event instead of sleeping between ``is_completed()`` polls sees
    a gloo work's completion at once: a poll that had backed off to 10-20 ms saw the last
    chunk of a version that much late, and a sender waiting for a staging buffer posted
    the next chunks that much late. ``is_completed()`` stays the test (a NCCL work's
    future completes as the work is queued); where a backend gives no future, ``wake`` is
    never set and callers' bounded waits make them poll."""
    try:
        work.get_future().add_done_callback(lambda _future: wake.set())
    except (RuntimeError, AttributeError, NotImplementedError):  # no future: the caller polls
        pass


def finished(work: Any, completes_when_done: bool) -> bool:
    """Whether ``work`` is done (then ``work.wait()`` returns at once, or raises what it
    raised). ``completes_when_done`` (gloo, CPU tensors): its future counts too. gloo
    completes a work's future, running the :func:`on_done` callbacks, a moment before
    ``is_completed()`` turns true; a waiter woken by the callback that looked at
    ``is_completed()`` alone could find it False and sleep a whole step (50 ms, for 4-6%
    of the chunks of a 500 MB version on two cores; tests/unit/test_nccl_waits.py)."""
    if work.is_completed():
        return True
    if not completes_when_done:
        return False  # a NCCL work's future completes as the work is queued
    try:
        return bool(work.get_future().done())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def wait(work: Any, deadline: Any, completes_when_done: bool = False) -> None:
    """Wait for ``work`` until ``deadline`` (a :class:`..common.control.Deadline`); raises what
    the work raised, or TimeoutError. Waits for its completion event (:func:`on_done`) in
    bounded steps instead of ``work.wait()``, which trusts the backend to honour its own
    timeout. ``completes_when_done``: the work's future completes when the work does (gloo,
    CPU tensors), so the event alone wakes the waiter and the steps can be long; otherwise
    (a NCCL work's future completes as it is queued) the steps start short and poll."""
    wake = threading.Event()
    on_done(work, wake)
    # A gloo chunk woke its waiter 4-6 times in 10 ms with short steps (0.1-0.2 ms of CPU per chunk).
    backoff = Backoff(0.05 if completes_when_done else 0.01)
    if completes_when_done:
        backoff.current = backoff.ceiling
    while True:
        # Cleared before each look: a completion after it sets the event again. (A NCCL
        # work's future completes when the work is queued, not done: then this polls.)
        wake.clear()
        if finished(work, completes_when_done):
            break
        if deadline.expired:
            raise TimeoutError(f"the transfer did not complete within {deadline.seconds:g} s")
        wake.wait(max(0.0, min(backoff.next(), deadline.remaining())))
    work.wait()


def destroy_soon(holder: list[Any]) -> None:
    """Abort a broken group in the background, and let go of it there.

    ``holder`` is a list holding the only reference to the group (the caller keeps no
    other). A gloo op waiting on a peer that died before it answered stays pending until
    its own timeout, and abort() does not cancel it; the group's destructor waits for
    it. Whoever drops the last reference runs that destructor, so it must be this
    thread, never the caller's."""

    def teardown() -> None:
        pg = holder.pop() if holder else None
        destroy(pg, graceful=False)
        del pg  # the destructor (possibly waiting out pending ops) runs here

    threading.Thread(target=teardown, name="forge-group-teardown", daemon=True).start()


def destroy_all(holder: list[Any], graceful: bool, timeout: float) -> bool:
    """Tear down the groups in ``holder`` (which holds the only references to them),
    waiting at most ``timeout`` seconds; whether it finished. If not, the rest, and the
    groups' destructors, go on in the background."""

    def teardown() -> None:
        while holder:
            pg = holder.pop()
            if pg is not None:
                destroy(pg, graceful)
            del pg

    t = threading.Thread(target=teardown, name="forge-group-teardown", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def destroy(pg: Any, graceful: bool = True) -> None:
    """Tear a group down: ``shutdown`` for a healthy group (both sides call it, or the
    process aborts at exit), ``abort`` for one whose peer may be gone."""
    if pg is None:
        return
    for method in ("shutdown", "abort") if graceful else ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as exc:  # noqa: BLE001 - best effort; the other method may work
            log.debug("process group %s() failed: %s", method, exc)
