"""Who may take part in a transfer: the run's secret, the run's interface, private files.

For ``nccl`` and ``rdma`` the sender's control store listens on the run's interface only
(loopback here) and every value the transports act on is signed with the run's secret
(plugins/forgerl_plugins/transports/common/auth.py). A receiver without the secret or with a wrong one is
refused with a message that says so; a stranger who reaches the store's port (listing,
reading and writing keys as any TCPStore client can) cannot register, and what it writes
is never taken for the sender's: the legitimate receivers get the sender's weights,
bit-exact. ``shm`` keeps its directory 0700 and its files 0600.

The legitimate receivers run in their own processes (forgerl/testing/transport_receiver.py),
as generator workers do; the refused ones and the stranger run here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from forgerl.testing.transport_receiver import make_weights

from ..helpers.listeners import own_listeners
from ..helpers.timing import scaled, wait_until
from .test_transport_conformance import OPTIONS, create, expected, start_receiver

pytestmark = pytest.mark.integration
#: The cases about the control store: the ``name`` fixture (conftest.py) narrowed to its transports.
STORE_HOSTED = pytest.mark.parametrize("name", ["nccl", "rdma"], indirect=True)

NAMESPACES = {"nccl": "forgerl/nccl/", "rdma": "forgerl/rdma/"}


def _send(sender: Any, version: int, timeout: float = 30.0) -> None:
    from forgerl.types import WeightSet

    sender.send(WeightSet(version, make_weights(version)), timeout=scaled(timeout))


def _stranger(spec: dict[str, Any]) -> Any:
    """A plain TCPStore client: all anyone who reaches the port needs."""
    import datetime

    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=scaled(10))
    return TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)


def _other_local_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    candidates = set()
    try:
        candidates |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a documentation address: nothing is sent
            candidates.add(s.getsockname()[0])
        except OSError:
            pass
    return next((a for a in sorted(candidates) if not a.startswith("127.")), None)


# ------------------------------------------------------------- signed values


def test_store_values_are_signed_over_key_and_value():
    from forgerl_plugins.transports.common.auth import ForgedValue, Signer, new_secret
    from forgerl_plugins.transports.common.control import Control, start_server

    server = start_server(0, 5.0)
    mine, theirs = Signer(new_secret()), Signer(new_secret())
    ctl = Control(server, "ns/", mine, "127.0.0.1", server.port)
    ctl.set("latest", "7")
    assert ctl.get("latest") == b"7"
    from torch.distributed import PrefixStore

    raw = PrefixStore("ns/", server)
    raw.set("forged", "9")  # unsigned
    with pytest.raises(ForgedValue, match="not signed"):
        ctl.get("forged")
    raw.set("copied", raw.get("latest"))  # a signed value moved to another key
    with pytest.raises(ForgedValue):
        ctl.get("copied")
    Control(server, "ns/", theirs).set("other-run", "1")  # signed with another secret
    with pytest.raises(ForgedValue):
        ctl.get("other-run")
    raw.queue_push("events", '{"type": "join", "nonce": "x"}')
    ctl.push("events", {"type": "join", "nonce": "y"})
    assert ctl.pop_all("events") == [{"type": "join", "nonce": "y"}], "the unsigned event must be dropped"
    assert len(ctl.refused) == 1


def test_the_run_secret_is_private_and_shared_by_one_run(tmp_path):
    from forgerl.errors import TransportError
    from forgerl_plugins.transports.common.auth import SECRET_FILE, run_secret

    first = run_secret(tmp_path)
    assert run_secret(tmp_path) == first, "one run, one secret"
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert len(first) == 64 and run_secret(tmp_path / "other-run") != first
    (tmp_path / SECRET_FILE).chmod(0o644)
    with pytest.raises(TransportError, match="chmod 600"):
        run_secret(tmp_path)


# ------------------------------------------------------------ the interface


@STORE_HOSTED
@pytest.mark.hard_timeout(120)
def test_store_and_groups_listen_on_the_run_interface_only(name: str, endpoints: list) -> None:
    transport = create(name)
    spec = transport.receiver_spec()
    sender = transport.sender()
    try:
        receiver = start_receiver(endpoints, name, spec, "gen.0", [1])
        receiver.wait("ready", timeout=scaled(60))
        _send(sender, 1)
        receiver.wait("received", 1, timeout=scaled(30))
        listening = own_listeners()
        assert ("127.0.0.1", spec["port"]) in listening, f"store {spec['port']} not on loopback: {listening}"
        if name == "nccl":  # the sender's gloo listeners as well (Mooncake binds its own: docs/security.md)
            wide = {(a, p) for a, p in listening if not (a.startswith("127.") or a == "::1")}
            assert not wide, f"the nccl sender listens beyond loopback: {sorted(wide)}"
        other = _other_local_address()
        if other is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, spec["port"]), timeout=scaled(5)).close()
    finally:
        sender.close()
        transport.close()


# ----------------------------------------------------------------- the secret


@STORE_HOSTED
@pytest.mark.hard_timeout(150)
def test_receivers_without_the_secret_are_refused_and_the_sender_goes_on(
    name: str, endpoints: list, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed import PrefixStore

    from forgerl.errors import TransportError
    from forgerl_plugins.transports.common.auth import new_secret

    caplog.set_level(logging.INFO)
    transport = create(name)
    spec = transport.receiver_spec()
    sender = transport.sender()
    try:
        legit = start_receiver(endpoints, name, spec, "gen.0", [1, 2])
        legit.wait("ready", timeout=scaled(60))
        # Built as a generator worker builds its receiver, from a spec with no or another secret.
        elsewhere = create(name)
        with pytest.raises(TransportError, match="no transport secret"):
            elsewhere.receiver("no-secret", {k: v for k, v in spec.items() if k != "secret"})
        with pytest.raises(TransportError, match="secret does not match"):
            elsewhere.receiver("wrong-secret", {**spec, "secret": new_secret()})
        # A stranger registers the way a receiver would, minus the signature.
        stranger = PrefixStore(NAMESPACES[name], _stranger(spec))
        join = {"type": "join", "nonce": "f" * 16, "worker_id": "stranger", "pid": 1, "host": "127.0.0.1"}
        stranger.set("m/" + "f" * 16 + "/ack", "-1")
        stranger.queue_push("events", json.dumps(join))
        _send(sender, 1)
        assert legit.wait("received", 1, timeout=scaled(30))["digests"] == expected(1)
        _send(sender, 2)
        assert legit.wait("received", 2, timeout=scaled(30))["digests"] == expected(2)
    finally:
        sender.close()
        transport.close()
    log = caplog.text
    assert "refused a message not signed" in log, "the stranger's registration was not reported"
    assert "'stranger' registered" not in log and "'gen.0' registered" in log
    assert "'no-secret'" not in log and "'wrong-secret'" not in log, "a refused receiver registered"


@STORE_HOSTED
@pytest.mark.hard_timeout(150)
def test_what_a_stranger_writes_is_never_taken_for_the_senders(name: str, endpoints: list) -> None:
    """A stranger overwrites every key it can list, as the legitimate receiver waits: it
    can disrupt a transfer, never make the receiver yield anything but the sender's."""
    from forgerl.errors import TransportError

    transport = create(name)
    spec = transport.receiver_spec()
    sender = transport.sender()
    try:
        legit = start_receiver(endpoints, name, spec, "gen.0", [1, 2], timeout=60.0)
        legit.wait("ready", timeout=scaled(60))
        raw = _stranger(spec)
        keys = wait_until(
            lambda: [k for k in raw.list_keys() if "/m/" in k], 30, "the receiver's keys in the store"
        )
        forged_layout = json.dumps({"version": 1, "entries": [], "chunks": [], "nbytes": 0})
        forged_offer = json.dumps({"version": 1, "session": "127.0.0.1:1", "address": 4096, "slot": 0})
        for key in raw.list_keys() + [k.rsplit("/", 1)[0] + f"/offer/{s}" for k in keys for s in range(3)]:
            # (Not the queue, and not the sender's proof: a receiver that finds that forged
            # refuses the sender for good, as it would with a wrong secret.)
            if "events" not in key and "auth/proof" not in key:
                raw.set(key, forged_layout if "offer" in key or key.endswith("meta") else "1")
        raw.set(NAMESPACES[name] + "/current", forged_offer)
        raw.set(NAMESPACES[name] + "/latest", "1")
        try:
            _send(sender, 1)
        except TransportError:
            pass  # the forgeries broke the receiver's first attempt: it registers again
        assert legit.wait("received", 1, timeout=scaled(60))["digests"] == expected(1)
        _send(sender, 2)
        assert legit.wait("received", 2, timeout=scaled(30))["digests"] == expected(2)
    finally:
        sender.close()
        transport.close()


# ----------------------------------------------------------------------- shm


def test_shm_directory_is_private_and_its_files_too(tmp_path):
    from forgerl.types import WeightSet

    transport = create("shm")
    sender = transport.sender()
    try:
        directory = Path(transport.receiver_spec()["directory"])
        sender.send(WeightSet(1, make_weights(1)))
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, oct(directory.stat().st_mode)
        files = list(directory.iterdir())
        assert files, "nothing was written"
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
        loose = {n: oct(m) for n, m in modes.items() if m != 0o600}
        assert not loose, f"files others could read: {loose}"
    finally:
        sender.close()
    # A directory the user names is created private too.
    from forgerl_plugins.transports.shm.transport import ShmTransport

    named = tmp_path / "deep" / "weights"
    old = os.umask(0o022)
    try:
        options = ShmTransport.Options(directory=str(named), **OPTIONS["shm"])
        sender = ShmTransport(options, context=None).sender()
    finally:
        os.umask(old)
    try:
        sender.send(WeightSet(1, make_weights(1)))
        assert stat.S_IMODE(named.stat().st_mode) == 0o700
        assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in named.iterdir()} == {oct(0o600)}
    finally:
        sender.close()
