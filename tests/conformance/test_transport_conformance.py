"""The behaviour every weight transport must have, run against each (shm, nccl, rdma, delta).

The cases are the transport kit of forgerl.testing (forgerl/testing/transport.py), which a
third-party transport runs the same way, by naming its backend: this file only says what
each built-in transport promises (its :class:`TransportCase`) and adds what the kit cannot
know in general (rdma's Mooncake engine port and registered memory), plus one regression
test of the control store that nccl and rdma share.

``shm`` is pull-based: its ``send`` returns once a version is published and never learns
who read it, so the cases about naming a receiver that did not take a version apply to
nccl and rdma only.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from forgerl.testing import TransportCase, TransportContract
from forgerl.testing.transport_receiver import make_weights
from forgerl.testing.transport_support import expected
from forgerl.testing.transport_support import start_receiver as start_receiver_of

from ..conftest import TRANSPORTS
from ..helpers.requires import require_mooncake
from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

#: Small buckets/chunks so that even test-sized versions move in several pieces. nccl's
#: sender sees a receiver's connection drop; rdma's only its silence; shm's never waits.
CASES: dict[str, TransportCase] = {
    "shm": TransportCase("shm", {"poll_interval": 0.01}, confirms_delivery=False),
    "nccl": TransportCase(
        "nccl", {"bucket_mb": 4, "connect_timeout": 20, "stall_timeout": 2}, sees_dead_peers=True
    ),
    # CI sets FORGE_REQUIRE_RDMA=1: a broken Mooncake install fails instead of skipping.
    "rdma": TransportCase(
        "rdma", {"chunk_mb": 4, "connect_timeout": 20}, required=os.environ.get("FORGE_REQUIRE_RDMA") == "1"
    ),
    # One TCP connection per receiver: a dead one's connection drops, which the sender sees.
    # Its extra (zstandard, xxhash) is always installed by scripts/setup.sh: never skipped.
    "delta": TransportCase(
        "delta",
        {"block_mb": 1, "connect_timeout": 20, "stall_timeout": 5},
        sees_dead_peers=True,
        required=True,
    ),
}
#: Each transport's test options (the auth and fault tests use them too).
OPTIONS: dict[str, dict[str, Any]] = {name: dict(case.options) for name, case in CASES.items()}

__all__ = ["CASES", "OPTIONS", "create", "expected", "start_receiver"]


def create(name: str) -> Any:
    return CASES[name].create()


def start_receiver(endpoints: list, name: str, spec: dict, worker_id: str, versions: list[int], **kw: Any):
    """A receiver process of transport ``name`` (see forgerl.testing.transport_support)."""
    return start_receiver_of(endpoints, CASES[name], spec, worker_id, versions, **kw)


def _engine_port(sender: Any) -> int:
    return int(sender.session.rsplit(":", 1)[1])


class TestTransportConformance(TransportContract):
    # delta runs the kit here only: the fault and auth suites (TRANSPORTS) test the control
    # store that nccl and rdma share, which delta does not use (tests/unit/test_delta_*.py).
    @pytest.fixture(params=[*TRANSPORTS, "delta"])
    def transport_case(self, request: pytest.FixtureRequest) -> TransportCase:
        return CASES[request.param]

    def held_ports(self, case: TransportCase, sender: Any, spec: Any) -> set[int]:
        ports = super().held_ports(case, sender, spec)
        if case.backend == "rdma":
            ports.add(_engine_port(sender))  # the Mooncake engine's
        return ports

    def check_open(self, case: TransportCase, transport: Any, sender: Any, spec: Any) -> None:
        super().check_open(case, transport, sender, spec)
        if case.backend == "rdma":
            assert sender.registered_bytes > 0, "the sender should hold registered memory before close"

    def check_receiver_closed(self, case: TransportCase, event: Any) -> None:
        super().check_receiver_closed(case, event)
        if case.backend == "rdma":
            assert event["registered_before_close"] > 0, event


@pytest.mark.hard_timeout(90)
@pytest.mark.parametrize("confirming", [n for n in TRANSPORTS if CASES[n].confirms_delivery])
def test_a_receiver_that_acknowledges_then_closes_took_the_version(
    confirming: str, endpoints: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender reads a receiver's acknowledgement, then whether it closed. A receiver
    that took the version, acknowledged and closed between those two reads (a generator
    worker that took its last version and exited; seen in CI from `forge bench`) took the
    version, and the send succeeds. The interleaving is forced: the first acknowledgement
    read after version 1 waits for the receiver to have closed, then answers as it would
    have before the acknowledgement landed."""
    from forgerl.types import WeightSet
    from forgerl_plugins.transports.common.control import Control

    name = confirming
    if name == "rdma":
        require_mooncake()
    threads_before = set(threading.enumerate())
    transport = create(name)
    sender = transport.sender()
    spec = transport.receiver_spec()
    receiver = start_receiver(endpoints, name, spec, "gen.0.worker", [1, 2])
    receiver.wait("ready", timeout=scaled(60))
    sender.send(WeightSet(1, make_weights(1)), timeout=scaled(30))
    assert receiver.wait("received", 1)["digests"] == expected(1)

    real_get, real_get_many = Control.get, Control.get_many
    stale_reads: list[str] = []

    def stale_first_ack(ctl: Control, key: str, value: bytes | None) -> bytes | None:
        if not key.endswith("/ack") or stale_reads:
            return value
        closed_key = key[: -len("ack")] + "closed"
        wait_until(lambda: real_get(ctl, closed_key) is not None, 30, "the receiver to ack and close")
        stale_reads.append(key)
        return b"-1"  # what the key held before the receiver's acknowledgement of version 2

    monkeypatch.setattr(Control, "get", lambda self, key, deadline=None: stale_first_ack(
        self, key, real_get(self, key, deadline)))
    monkeypatch.setattr(Control, "get_many", lambda self, keys, deadline=None: [
        stale_first_ack(self, k, v) for k, v in zip(keys, real_get_many(self, keys, deadline))])

    sender.send(WeightSet(2, make_weights(2)), timeout=scaled(30))
    assert stale_reads, "the sender never read an acknowledgement: the race was not forced"
    assert receiver.wait("received", 2)["digests"] == expected(2)
    receiver.wait("closed")
    assert receiver.finish() == 0, receiver.stderr_tail()
    monkeypatch.undo()
    TestTransportConformance().close_and_check_clean(CASES[name], transport, sender, spec, endpoints, threads_before)
