"""The Transport kit: the behaviour every weight transport must have, checked against one
backend by name, with receivers in their own processes.

The sender lives in the test process (as on trainer rank 0) or in a helper process when
it must die; receivers always live in their own processes
(:mod:`forgerl.testing.transport_receiver`), built from the sender's ``receiver_spec()``
the way a generator worker builds them. Helpers are forked from a forkserver that imported
torch once, or started as fresh interpreters with ``FORGE_CONFORMANCE_SPAWN=subprocess``
(:mod:`forgerl.testing.endpoints`). Every test runs under a hard time limit
(:attr:`TransportContract.hard_limits`), so a transport that hangs fails its test.

What it checks:

- every tensor arrives bit-exact (bf16, fp16, fp32, int64, bool; 0-d and empty tensors;
  dotted names), in the sender's order, in every receiver;
- a receiver that dies in the middle of a transfer: a push transport
  (``confirms_delivery``) fails the send within its timeout with a TransportError naming
  that receiver's worker id and no other (one that ``sees_dead_peers`` with a TransportError
  that is not a TransportTimeout: noticed, not waited out); a pull transport's send is not
  held up; either way the survivor gets the version, and the next version reaches it
  without waiting for the dead one;
- versions strictly increase: ``send`` of an equal or older version raises ValueError;
- a receiver that joins late (a restarted worker, same worker id) gets the current version;
- a sender that dies: a receiver yields nothing of the version in flight (or all of it) and
  raises TransportTimeout within its timeout for the next one;
- nothing blocks forever: ``receive`` of a version never sent, and (push transports) a
  ``send`` that a registered receiver never takes, give up at their timeouts;
- after ``close()``: no helper processes, no threads the transport started, no listening
  ports it held (:meth:`TransportContract.held_ports`), no paths it created
  (:meth:`TransportContract.held_paths`), no /dev/shm entries of these processes, no
  registered memory (a ``registered_bytes`` attribute of the sender or receiver, when
  they have one).

``shm`` is pull-based: its ``send`` returns once a version is published and never learns
who read it (the interface allows that), so the cases about naming a receiver that did
not take a version apply to push transports only; for a pull transport they check that
``send`` is not held up and that the survivors still get every version.

The kit builds every transport with ``context=None``, the sender's side included: its
options must be enough to build a sender outside a run (e.g. a directory to publish in).

A plugin's test names its transport in a subclass::

    class TestMyTransport(TransportContract):
        backend = "my_transport"
        options = {"chunk_mb": 4}
        confirms_delivery = True

Several transports (or option sets) in one class: override the ``transport_case`` fixture
with ``params`` returning a :class:`TransportCase` each.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from forgerl.testing.endpoints import Endpoint
from forgerl.testing.timing import hard_limit, scaled, wait_until
from forgerl.testing.transport_receiver import make_weights
from forgerl.testing.transport_support import (
    SLACK_S,
    TransportCase,
    expected,
    listening_ports,
    shm_entries_of,
    start_receiver,
    start_sender,
    threads_left,
)

__all__ = ["TransportCase", "TransportContract"]


class TransportContract:
    """Base class of a plugin's transport conformance tests (see the module's docstring)."""

    #: The transport's backend name, as ``transport.name`` in a config.
    backend: ClassVar[str] = ""
    #: Its options, as ``transport.options`` holds them (plain data).
    options: ClassVar[Mapping[str, Any]] = {}
    #: Whether ``send`` waits for every registered receiver (see :class:`TransportCase`).
    confirms_delivery: ClassVar[bool] = True
    #: Whether the sender notices a dead receiver before the send's timeout.
    sees_dead_peers: ClassVar[bool] = False
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: Fail, rather than skip, when the backend cannot be used here.
    required: ClassVar[bool] = False
    #: Seconds (scaled) each test may run before it fails instead of hanging the suite.
    hard_limits: ClassVar[Mapping[str, float]] = {
        "test_delivery_dead_receiver_and_restarted_receiver": 150,
        "test_sender_dying_makes_receivers_time_out_cleanly": 120,
        "test_nothing_blocks_forever": 60,
    }
    default_hard_limit: ClassVar[float] = 90
    #: Seconds (scaled) the threads a transport started get to end after its close.
    thread_exit_wait_s: ClassVar[float] = 15

    # ---------------------------------------------------------------- fixtures

    @pytest.fixture
    def transport_case(self) -> TransportCase:
        """The transport under test, from the class's attributes."""
        return TransportCase(
            backend=self.backend,
            options=dict(self.options),
            confirms_delivery=self.confirms_delivery,
            sees_dead_peers=self.sees_dead_peers,
            plugins=tuple(self.plugins),
            required=self.required,
        )

    @pytest.fixture
    def endpoints(self) -> Iterator[list[Endpoint]]:
        """Every helper process a test starts; killed at teardown whatever happened."""
        started: list[Endpoint] = []
        yield started
        for ep in started:
            ep.cleanup()

    @pytest.fixture(autouse=True)
    def _hard_timeout(self, request: pytest.FixtureRequest) -> Iterator[None]:
        name = getattr(request.function, "__name__", "")
        limit = max(1, int(scaled(self.hard_limits.get(name, self.default_hard_limit))))
        with hard_limit(limit, f"{request.node.nodeid} ran past its hard timeout of {limit} s"):
            yield

    # ------------------------------------------------------------------- hooks

    def held_ports(self, case: TransportCase, sender: Any, spec: Mapping[str, Any]) -> set[int]:
        """TCP ports the transport listens on while open and must release at close: by
        default the ``port`` of its receiver spec, when it has one."""
        port = spec.get("port")
        return {port} if isinstance(port, int) else set()

    def held_paths(self, case: TransportCase, spec: Mapping[str, Any]) -> list[Path]:
        """Paths the transport creates and must remove at close: by default the
        ``directory`` of its receiver spec, when it has one and the options did not name it
        (a directory the user named is the user's)."""
        directory = spec.get("directory")
        if not isinstance(directory, str) or directory == case.options.get("directory"):
            return []
        return [Path(directory)]

    def check_open(self, case: TransportCase, transport: Any, sender: Any, spec: Mapping[str, Any]) -> None:
        """What must hold of an open transport before it is closed."""
        for port in self.held_ports(case, sender, spec):
            assert port in listening_ports(), f"port {port} should be listening before close"

    def check_receiver_closed(self, case: TransportCase, event: Mapping[str, Any]) -> None:
        """What a receiver process reports once it closed its receiver (``closed`` event)."""
        assert event["registered_bytes"] == 0, f"{event['registered_bytes']} bytes left registered"

    def close_and_check_clean(
        self,
        case: TransportCase,
        transport: Any,
        sender: Any,
        spec: Mapping[str, Any],
        endpoints: list[Endpoint],
        threads_before: set[threading.Thread],
    ) -> None:
        """Close the sender and the transport; then nothing they or the receivers held may
        be left."""
        pids = {os.getpid(), *(ep.pid for ep in endpoints)}
        ports = self.held_ports(case, sender, spec)
        self.check_open(case, transport, sender, spec)
        sender.close()
        transport.close()
        for ep in endpoints:
            ep.kill()
        leftover = [ep.label for ep in endpoints if ep.alive()]
        assert not leftover, f"helper processes still alive after close: {leftover}"
        for port in ports:

            def released(port: int = port) -> bool:
                return port not in listening_ports()

            wait_until(released, 5, f"port {port} to close")
        stacks = threads_left(threads_before, self.thread_exit_wait_s)
        assert not stacks, f"threads the transport started still run after close:\n{stacks}"
        registered = getattr(sender, "registered_bytes", 0)
        assert registered == 0, f"{registered} bytes still registered after the sender closed"
        left = [str(p) for p in self.held_paths(case, spec) if p.exists()]
        assert not left, f"left behind after close: {left}"
        assert not shm_entries_of(pids), f"/dev/shm entries left: {shm_entries_of(pids)}"

    # ------------------------------------------------------------------- cases

    def test_delivery_dead_receiver_and_restarted_receiver(
        self, transport_case: TransportCase, endpoints: list[Endpoint]
    ) -> None:
        """Bit-exact versions in order; a receiver that dies mid-transfer is named (push
        transports) and the survivor goes on; a restarted receiver gets the current version.
        (One scenario, so that the suite starts few processes: importing torch costs seconds.)"""
        from forgerl.errors import TransportError, TransportTimeout
        from forgerl.types import WeightSet

        case = transport_case
        threads_before = set(threading.enumerate())
        transport = case.create()
        sender = transport.sender()
        spec = transport.receiver_spec()
        survivor = start_receiver(endpoints, case, spec, "gen.0.worker", [1, 2, 3], rejoin=3)
        victim = start_receiver(endpoints, case, spec, "gen.1.worker", [1, 2], die_when_started=2)
        survivor.wait("ready", timeout=scaled(60))
        victim.wait("ready", timeout=scaled(60))

        sender.send(WeightSet(1, make_weights(1)), timeout=scaled(30))
        want = expected(1)
        for r in (survivor, victim):
            got = r.wait("received", 1)["digests"]
            assert list(got) == list(want), f"names or order differ: {list(got)} vs {list(want)}"
            bad = [n for n in want if got[n] != want[n]]
            assert not bad, f"{r.label}: version 1 is not bit-exact for {bad}"

        # Version 2 (64 MiB): the victim kills itself once its transfer has started.
        timeout = 6.0
        start = time.monotonic()
        if case.confirms_delivery:
            with pytest.raises(TransportError) as err:
                sender.send(WeightSet(2, make_weights(2, big=True)), timeout=timeout)
            message = str(err.value)
            assert "'gen.1.worker'" in message and "'gen.0.worker'" not in message, message
            if case.sees_dead_peers:
                # Noticed (the broken connection), not waited out to the timeout.
                assert not isinstance(err.value, TransportTimeout), f"waited out, not noticed: {message}"
        else:
            sender.send(WeightSet(2, make_weights(2, big=True)), timeout=timeout)
        elapsed = time.monotonic() - start
        assert elapsed < timeout + scaled(SLACK_S), f"send took {elapsed:.1f} s with a {timeout} s timeout"
        assert victim.finish() == -signal.SIGKILL, "the victim should have died mid-transfer"
        assert survivor.wait("received", 2)["digests"] == expected(2, big=True)

        # The next version reaches the survivor without waiting for the dead one: had the
        # send counted on it, it would raise naming it (a dead receiver never acknowledges).
        sender.send(WeightSet(3, make_weights(3)), timeout=scaled(30))
        assert survivor.wait("received", 3)["digests"] == expected(3)

        # Versions only go forward (ValueError; its words are the transport's own).
        for stale in (3, 2):
            with pytest.raises(ValueError):
                sender.send(WeightSet(stale, make_weights(stale)), timeout=scaled(5))

        # The survivor's worker restarts (a new receiver, same worker id): it joins after
        # version 3 was sent and gets version 3.
        rejoined = survivor.wait("received", 3)
        assert rejoined.get("rejoined") and rejoined["digests"] == expected(3)
        self.check_receiver_closed(case, survivor.wait("closed"))
        assert survivor.finish() == 0, survivor.stderr_tail()
        self.close_and_check_clean(case, transport, sender, spec, endpoints, threads_before)

    def test_sender_dying_makes_receivers_time_out_cleanly(
        self, transport_case: TransportCase, endpoints: list[Endpoint]
    ) -> None:
        case = transport_case
        sender = start_sender(endpoints, case, [1, 2], big=True)
        spec = sender.wait("spec", timeout=scaled(90))["spec"]
        try:
            timeout = 5.0
            r = start_receiver(endpoints, case, spec, "gen.0", [1, 2, 3], timeout=timeout, wait_go=True)
            ready = r.wait("ready", timeout=scaled(90))
            r.tell("go")
            sender.tell("send 1")
            r.wait("received", 1, timeout=scaled(30))
            sender.tell("send 2")
            if ready.get("progress"):
                r.wait("started", 2, timeout=scaled(60))  # the transfer of version 2 is under way
            sender.kill()
            # Version 2 either arrived whole before the kill or times out; it is never partial.
            outcome = None
            while outcome is None:
                ev = r.events.get(timeout=timeout + scaled(30))
                if ev["event"] in ("received", "error") and ev.get("version") == 2:
                    outcome = ev
            if outcome["event"] == "received":
                assert outcome["digests"] == expected(2, big=True)
            else:
                assert outcome["type"] == "TransportTimeout", outcome
                assert outcome["yielded"] == 0, f"yielded {outcome['yielded']} tensors of a version that failed"
                assert outcome["seconds"] < timeout + scaled(SLACK_S), outcome
            # With the sender gone, the next version times out, within the receiver's timeout.
            err = r.wait("error", 3, timeout=timeout + scaled(30))
            assert err["type"] == "TransportTimeout" and err["yielded"] == 0, err
            assert err["seconds"] < timeout + scaled(SLACK_S), err
            assert "3" in err["message"], err["message"]
            self.check_receiver_closed(case, r.wait("closed"))
            assert r.finish() == 0
        finally:
            for path in self.held_paths(case, spec):  # a killed sender cannot clean up
                shutil.rmtree(path, ignore_errors=True)

    def test_nothing_blocks_forever(self, transport_case: TransportCase) -> None:
        from forgerl.errors import TransportTimeout
        from forgerl.types import WeightSet

        case = transport_case
        threads_before = set(threading.enumerate())
        transport = case.create()
        sender = transport.sender()
        spec = transport.receiver_spec()
        idle = transport.receiver("idle.worker", spec)
        # Nothing was sent: the receiver gives up at its timeout.
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            list(idle.receive(1, timeout=1.0))
        took = time.monotonic() - start
        assert took < 1.0 + scaled(SLACK_S), f"receive of a version never sent gave up after {took:.1f} s, timeout 1 s"
        # A registered receiver that never takes the version: the send gives up at its timeout.
        start = time.monotonic()
        if case.confirms_delivery:
            with pytest.raises(TransportTimeout, match=r"idle.worker"):
                sender.send(WeightSet(1, make_weights(1)), timeout=1.0)
        else:
            sender.send(WeightSet(1, make_weights(1)), timeout=1.0)
        took = time.monotonic() - start
        assert took < 1.0 + scaled(SLACK_S), f"send gave up after {took:.1f} s, timeout 1 s"
        idle.close()
        self.close_and_check_clean(case, transport, sender, spec, [], threads_before)
