"""The behaviour every weight transport must have, run against each (shm, nccl, rdma).

The sender lives in the test process (as on trainer rank 0) or in a helper process when
it must die; receivers always live in their own processes
(tests/helpers/transport_receiver.py), built from the sender's ``receiver_spec()`` the way
a generator worker builds them.

``shm`` is pull-based: its ``send`` returns once a version is published and never learns
who read it (the interface allows that), so the cases about naming a receiver that did
not take a version apply to the push/acknowledged transports only; for shm they check
that ``send`` is not held up and that the survivors still get every version.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from ..helpers.requires import require_mooncake
from ..helpers.timing import scaled, wait_until
from ..helpers.transport_receiver import digest, make_weights
from .conftest import TRANSPORTS
from .endpoints import Endpoint

pytestmark = pytest.mark.integration

#: Transports whose ``send`` waits for every registered receiver and names the ones that
#: did not take the version.
CONFIRMS_DELIVERY = {"shm": False, "nccl": True, "rdma": True}
#: Transports whose sender sees a receiver's connection drop (rather than its silence).
SEES_DEAD_PEERS = {"nccl"}
#: Small buckets/chunks so that even test-sized versions move in several pieces.
OPTIONS: dict[str, dict[str, Any]] = {
    "shm": {"poll_interval": 0.01},
    "nccl": {"bucket_mb": 4, "connect_timeout": 20, "stall_timeout": 2},
    "rdma": {"chunk_mb": 4, "connect_timeout": 20},
}
#: Slack on top of a timeout for process scheduling on a busy 2-core machine (scaled).
SLACK_S = 4.0


def create(name: str) -> Any:
    from forgerl.plugins import build_registry

    return build_registry().require("transport", name).build(OPTIONS[name], context=None)


def expected(version: int, big: bool = False) -> dict[str, str]:
    return {n: digest(n, t) for n, t in make_weights(version, big).items()}


# --------------------------------------------------------------------- processes


def start_receiver(
    endpoints: list,
    name: str,
    spec: dict,
    worker_id: str,
    versions: list[int],
    timeout: float | None = None,
    die_when_started: int | None = None,
    rejoin: int | None = None,
    wait_go: bool = False,
    options: dict[str, Any] | None = None,
    stop_when_started: int | None = None,
) -> Endpoint:
    """A receiver process built from the sender's ``spec``, which reaches it on its stdin:
    the spec carries the transport secret, and ``ps`` shows command lines to every user."""
    args = [
        "--transport",
        name,
        "--options",
        json.dumps(OPTIONS[name] if options is None else options),
        "--worker-id",
        worker_id,
        "--versions",
        ",".join(map(str, versions)),
        "--timeout",
        str(scaled(30.0) if timeout is None else timeout),
    ]
    if die_when_started is not None:
        args += ["--die-when-started", str(die_when_started)]
    if stop_when_started is not None:
        args += ["--stop-when-started", str(stop_when_started)]
    if rejoin is not None:
        args += ["--rejoin", str(rejoin)]
    if wait_go:
        args.append("--wait-go")
    ep = Endpoint(args, f"receiver {worker_id} ({name})")
    endpoints.append(ep)
    ep.tell(json.dumps(spec))
    return ep


# ------------------------------------------------------------------------ leaks


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def shm_entries_of(pids: set[int]) -> list[str]:
    """Files in /dev/shm whose names carry one of these process ids (how shm temp files,
    torch's and gloo's segments are named)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    # The id as a whole token: a random name such as multiprocessing's ``psm_40393bbd``
    # holds the digits of pid 4039 without being its segment.
    ids = re.compile(r"(?<![0-9A-Za-z])(" + "|".join(map(str, pids)) + r")(?![0-9A-Za-z])")
    return [n for n in names if ids.search(n)]


def close_and_check_clean(
    name: str, transport: Any, sender: Any, spec: dict, endpoints: list[Endpoint]
) -> None:
    """Close the sender; then nothing it or the receivers held may be left."""
    pids = {os.getpid(), *(ep.pid for ep in endpoints)}
    engine_port = None
    if name == "rdma":
        engine_port = int(sender.session.rsplit(":", 1)[1])
        assert engine_port in listening_ports(), (
            "the sender's Mooncake engine should be listening before close"
        )
        assert sender.registered_bytes > 0, "the sender should hold registered memory before close"
    sender.close()
    if hasattr(transport, "close"):
        transport.close()
    for ep in endpoints:
        ep.kill()
    leftover = [ep.label for ep in endpoints if ep.alive()]
    assert not leftover, f"helper processes still alive after close: {leftover}"
    if name in ("nccl", "rdma"):
        port = spec["port"]
        wait_until(lambda: port not in listening_ports(), 5, f"control store port {port} to close")
        # A broken group's teardown waits out its pending ops (bounded by their timeouts).
        try:
            wait_until(
                lambda: not any(t.name.startswith("forge-") for t in threading.enumerate()),
                15,
                "the transport's threads to end",
            )
        except AssertionError:
            pass  # reported below, with their stacks
        threads = [t for t in threading.enumerate() if t.name.startswith("forge-")]
        frames = sys._current_frames()
        stacks = "\n".join(
            f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
            for t in threads
            if t.ident in frames
        )
        assert not threads, (
            f"transport threads still running after close: {[t.name for t in threads]}\n{stacks}"
        )
    if name == "rdma":
        assert sender.registered_bytes == 0, f"{sender.registered_bytes} bytes still registered with Mooncake"
        assert engine_port not in listening_ports(), f"Mooncake engine port {engine_port} still listening"
    if name == "shm":
        assert not Path(spec["directory"]).exists(), f"{spec['directory']} left behind"
    assert not shm_entries_of(pids), f"/dev/shm entries left: {shm_entries_of(pids)}"


# ------------------------------------------------------------------------ cases


@pytest.mark.hard_timeout(150)
def test_delivery_dead_receiver_and_restarted_receiver(name: str, endpoints: list) -> None:
    """Bit-exact versions in order; a receiver that dies mid-transfer is named (push
    transports) and the survivor goes on; a restarted receiver gets the current version.
    (One scenario, so that the suite starts few processes: importing torch costs seconds.)"""
    from forgerl.errors import TransportError
    from forgerl.types import WeightSet

    transport = create(name)
    sender = transport.sender()
    spec = transport.receiver_spec()
    survivor = start_receiver(endpoints, name, spec, "gen.0.worker", [1, 2, 3], rejoin=3)
    victim = start_receiver(endpoints, name, spec, "gen.1.worker", [1, 2], die_when_started=2)
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
    if CONFIRMS_DELIVERY[name]:
        with pytest.raises(TransportError) as err:
            sender.send(WeightSet(2, make_weights(2, big=True)), timeout=timeout)
        message = str(err.value)
        assert "'gen.1.worker'" in message and "'gen.0.worker'" not in message, message
    else:
        sender.send(WeightSet(2, make_weights(2, big=True)), timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + scaled(SLACK_S), f"send took {elapsed:.1f} s with a {timeout} s timeout"
    if name in SEES_DEAD_PEERS:
        # Noticed (the broken connection, or the stall rule), not waited out to the timeout.
        assert "did not take version 2 within" not in message, message
    assert victim.finish() == -signal.SIGKILL, "the victim should have died mid-transfer"
    assert survivor.wait("received", 2)["digests"] == expected(2, big=True)

    # The next version reaches the survivor without waiting for the dead one: had the send
    # counted on it, it would raise naming it (a dead receiver never acknowledges).
    sender.send(WeightSet(3, make_weights(3)), timeout=scaled(30))
    assert survivor.wait("received", 3)["digests"] == expected(3)

    # Versions only go forward.
    for stale in (3, 2):
        with pytest.raises(ValueError, match="strictly increase"):
            sender.send(WeightSet(stale, make_weights(stale)), timeout=scaled(5))

    # The survivor's worker restarts (a new receiver, same worker id): it joins after
    # version 3 was sent and gets version 3.
    rejoined = survivor.wait("received", 3)
    assert rejoined.get("rejoined") and rejoined["digests"] == expected(3)
    closed = survivor.wait("closed")
    assert closed["registered_bytes"] == 0, f"{closed['registered_bytes']} bytes left registered"
    if name == "rdma":
        assert closed["registered_before_close"] > 0, closed
    assert survivor.finish() == 0, survivor.stderr_tail()
    close_and_check_clean(name, transport, sender, spec, endpoints)


@pytest.mark.hard_timeout(120)
def test_sender_dying_makes_receivers_time_out_cleanly(name: str, endpoints: list, tmp_path: Path) -> None:
    # Where the sender will listen is fixed up front, so that both processes start at once.
    options = dict(OPTIONS[name])
    if name == "shm":
        spec = {"directory": str(Path(tempfile.mkdtemp(prefix="forgerl-conformance-", dir="/dev/shm")))}
        options["directory"] = spec["directory"]
    else:
        options["port"] = free_port()
        # Both sides read the secret that signs the control store from one 0600 file.
        options["secret_file"] = str(tmp_path / "transport.secret")
        spec = {"host": "127.0.0.1", "port": options["port"]}
    sender = Endpoint(
        [
            "--role",
            "sender",
            "--transport",
            name,
            "--options",
            json.dumps(options),
            "--big",
            "--versions",
            "1,2",
            "--timeout",
            str(scaled(30)),
        ],
        f"sender ({name})",
    )
    endpoints.append(sender)
    timeout = 5.0
    r = start_receiver(
        endpoints, name, spec, "gen.0", [1, 2, 3], timeout=timeout, wait_go=True, options=options
    )
    published = sender.wait("spec", timeout=scaled(90))["spec"]
    assert {k: published[k] for k in spec} == spec, published
    r.wait("ready", timeout=scaled(90))
    r.tell("go")
    sender.tell("send 1")
    r.wait("received", 1, timeout=scaled(30))
    sender.tell("send 2")
    if name != "shm":
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
    closed = r.wait("closed")
    assert closed["registered_bytes"] == 0
    assert r.finish() == 0
    if name == "shm":
        shutil.rmtree(spec["directory"], ignore_errors=True)  # a killed sender cannot clean up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.hard_timeout(60)
def test_nothing_blocks_forever(name: str) -> None:
    from forgerl.errors import TransportTimeout
    from forgerl.types import WeightSet

    transport = create(name)
    sender = transport.sender()
    spec = transport.receiver_spec()
    idle = transport.receiver("idle.worker", spec)
    # Nothing was sent: the receiver gives up at its timeout.
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="did not"):
        list(idle.receive(1, timeout=1.0))
    assert time.monotonic() - start < 1.0 + scaled(SLACK_S)
    # A registered receiver that never takes the version: the send gives up at its timeout.
    start = time.monotonic()
    if CONFIRMS_DELIVERY[name]:
        with pytest.raises(TransportTimeout, match="idle.worker"):
            sender.send(WeightSet(1, make_weights(1)), timeout=1.0)
    else:
        sender.send(WeightSet(1, make_weights(1)), timeout=1.0)
    assert time.monotonic() - start < 1.0 + scaled(SLACK_S)
    idle.close()
    close_and_check_clean(name, transport, sender, spec, [])


@pytest.mark.hard_timeout(90)
@pytest.mark.parametrize("confirming", [n for n in TRANSPORTS if CONFIRMS_DELIVERY[n]])
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
    close_and_check_clean(name, transport, sender, spec, endpoints)
