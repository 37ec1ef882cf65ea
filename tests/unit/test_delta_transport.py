"""The delta transport end to end on loopback: deltas against confirmed bases, every case in
which it must send a version whole, and what it does with peers that lie or misbehave.

The kit (tests/conformance/test_transport_conformance.py) checks the contract every
transport keeps; these check what is delta's own."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from forgerl.errors import TransportError, TransportTimeout
from forgerl.types import WeightSet
from forgerl_plugins.transports.common.control import Deadline
from forgerl_plugins.transports.delta import encoding, wire
from forgerl_plugins.transports.delta.receiver import DeltaReceiver
from forgerl_plugins.transports.delta.sender import DeltaSender
from forgerl_plugins.transports.delta.transport import DeltaTransport
from tests.helpers.timing import scaled, wait_until

T = scaled(30)


def _transport(**options: Any) -> DeltaTransport:
    options.setdefault("block_mb", 1)
    options.setdefault("connect_timeout", scaled(10))
    return DeltaTransport(DeltaTransport.Options(**options), context=None)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Everything a test opens, closed at teardown whatever happened."""
    objects: list[Any] = []
    yield objects
    for obj in reversed(objects):
        obj.close()


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(600, 256, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(256, generator=g).to(torch.float16),
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.zeros(0, 8),
    }


def _nudge(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change: ``fraction`` of each bf16 tensor's elements move."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        if t.dtype == torch.bfloat16:
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * fraction)]
            flat[idx] = flat[idx] * 1.05 + 0.01
        out[name] = t
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want), f"names or order differ: {list(got)} vs {list(want)}"
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{name}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        )
        assert torch.equal(_bits(g), _bits(w)), f"{name}: bytes differ"


def _sync(
    sender: DeltaSender, receivers: list[DeltaReceiver], version: int, weights: dict[str, torch.Tensor]
) -> None:
    """Send ``version`` while every receiver receives it (as a run does), and check them."""
    got: dict[str, Any] = {}

    def take(r: DeltaReceiver) -> None:
        try:
            got[r.worker_id] = {n: t.clone() for n, t in r.receive(version, timeout=T)}
        except Exception as exc:  # noqa: BLE001 - reported below, in the test's thread
            got[r.worker_id] = exc

    threads = [threading.Thread(target=take, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    sender.send(WeightSet(version, dict(weights)), timeout=T)
    for t in threads:
        t.join(T)
    for r in receivers:
        result = got.get(r.worker_id)
        assert not isinstance(result, Exception) and result is not None, f"{r.worker_id}: {result!r}"
        _same(result, weights)


def _served(sender: DeltaSender, version: int, worker: str) -> list[Any]:
    return [s for s in sender.served[version] if s.worker_id == worker]


def test_deltas_against_confirmed_bases_are_exact_and_small(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    a = transport.receiver("gen.0", transport.receiver_spec())
    b = transport.receiver("gen.1", transport.receiver_spec())
    made += [a, b]
    weights = _weights()
    _sync(sender, [a, b], 1, weights)
    full = sender.last_send_bytes
    assert all(s.full for s in sender.served[1]), "a new receiver gets the version whole"
    for v in range(2, 6):
        weights = _nudge(weights, 0.01, seed=v)
        _sync(sender, [a, b], v, weights)
        served = sender.served[v]
        assert [s.base for s in served] == [v - 1, v - 1], served
        assert sender.last_send_bytes < full / 10, f"version {v}: {sender.last_send_bytes} bytes, full {full}"
    # The encoding was made once for both receivers on the same base.
    assert len(sender._deltas) <= 1
    # Memory stays bounded: the current version and the one base both receivers hold.
    assert set(sender._versions) <= {4, 5}, set(sender._versions)


def test_unchanged_version_costs_almost_nothing(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    _sync(sender, [r], 2, {n: t.clone() for n, t in weights.items()})
    assert sender.last_send_bytes < 10_000, sender.last_send_bytes


def test_a_delta_not_smaller_than_the_full_version_is_sent_whole(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)

    def noise(seed: int) -> dict[str, torch.Tensor]:  # random bytes: their xor does not compress
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randint(-(2**62), 2**62, (200_000,), dtype=torch.int64, generator=g)}

    _sync(sender, [r], 1, noise(1))
    _sync(sender, [r], 2, noise(2))
    (served,) = _served(sender, 2, "gen.0")
    assert served.full and "not smaller" in served.why_full, served


def test_a_corrupted_base_is_caught_by_the_checksum_and_the_version_resent_whole(
    made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver whose held bytes changed (a generator that wrote into the views it was
    given, a bit flip) applies the delta to the wrong base: the checksum refuses it, the
    sender sends the version whole, and the receiver yields exactly the trainer's weights."""
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    views = dict(r.receive(1, timeout=T))
    views["model.layers.0.mlp.up_proj.weight"].view(-1)[7] += 1  # the base is no longer version 1
    caplog.set_level(logging.WARNING)
    weights = _nudge(weights, 0.01, seed=2)
    _sync(sender, [r], 2, weights)
    first, second = _served(sender, 2, "gen.0")
    assert first.base == 1 and second.full and "checksum mismatch" in second.why_full, (first, second)
    assert any(
        "checksum mismatch" in rec.getMessage() and "up_proj" in rec.getMessage() for rec in caplog.records
    )
    # Its base is version 2 again: the next version is a delta.
    _sync(sender, [r], 3, _nudge(weights, 0.01, seed=3))
    assert [s.base for s in _served(sender, 3, "gen.0")] == [2]


def test_a_corrupted_delta_is_refused_by_the_checksum(
    made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's delta is wrong (one xored byte flipped before compression): the receiver
    refuses it, never yields it, and gets the version whole."""
    real = encoding.delta_blocks

    def corrupt(new: Any, base: Any, block: int, comp: Any, width: Any = None) -> list[encoding.Block]:
        flipped = new.copy()
        if flipped.size:
            flipped[flipped.size // 2] ^= 0x40
        return real(flipped, base, block, comp, width)

    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    monkeypatch.setattr(encoding, "delta_blocks", corrupt)
    weights = _nudge(weights, 0.01, seed=5)
    _sync(sender, [r], 2, weights)  # checks the bytes yielded are the true version 2
    first, second = _served(sender, 2, "gen.0")
    assert first.base == 1 and second.full, (first, second)


def test_a_receiver_claiming_another_base_gets_the_version_whole(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    assert r._held is not None
    r._held.digest = "0" * 32  # claims version 1, holds other bytes
    weights = _nudge(weights, 0.01, seed=2)
    _sync(sender, [r], 2, weights)
    (served,) = _served(sender, 2, "gen.0")
    assert served.full and "digest differs" in served.why_full, served
    r._held.version = 77  # a base the sender never had
    weights = _nudge(weights, 0.01, seed=3)
    _sync(sender, [r], 3, weights)
    (served,) = _served(sender, 3, "gen.0")
    assert served.full and "not held by the sender" in served.why_full, served


def test_a_restarted_receiver_gets_the_version_whole(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    spec = transport.receiver_spec()
    r = transport.receiver("gen.0", spec)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    _sync(sender, [r], 2, _nudge(weights, 0.01, seed=2))
    r.close()
    again = transport.receiver("gen.0", spec)
    made.append(again)
    got = {n: t.clone() for n, t in again.receive(2, timeout=T)}  # joins late: the current version
    _same(got, _nudge(weights, 0.01, seed=2))
    late = _served(sender, 2, "gen.0")[-1]
    assert late.full and "holds no version" in late.why_full, late
    # The closed receiver's base is no longer kept.
    wait_until(lambda: set(sender._versions) == {2}, scaled(10), "the old base to be dropped")


def test_after_the_trainer_resumes_the_first_version_is_whole(made: list[Any], tmp_path: Path) -> None:
    """A restarted sender (same port, same secret) holds no bases: a receiver that kept its
    bytes reconnects by itself and gets the next version whole, then deltas again."""
    secret = tmp_path / "secret"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = _transport(port=port, secret_file=str(secret))
    sender = first.sender()
    r = first.receiver("gen.0")  # the fixed address and the secret file: no spec needed
    made.append(r)
    weights = _weights()
    _sync(sender, [r], 1, weights)
    _sync(sender, [r], 2, _nudge(weights, 0.01, seed=2))
    first.close()
    second = _transport(port=port, secret_file=str(secret))
    made.append(second)
    resumed = second.sender()
    weights = _nudge(weights, 0.01, seed=3)
    _sync(resumed, [r], 3, weights)
    (served,) = _served(resumed, 3, "gen.0")
    assert served.full and "not held by the sender" in served.why_full, served
    _sync(resumed, [r], 4, _nudge(weights, 0.01, seed=4))
    assert [s.base for s in _served(resumed, 4, "gen.0")] == [3]


def test_a_receiver_with_another_secret_is_refused_in_one_line(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    spec = dict(transport.receiver_spec(), secret="f" * 64)
    with pytest.raises(TransportError) as err:
        transport.receiver("intruder", spec)
    message = str(err.value)
    assert "\n" not in message and "secret" in message and "intruder" in message, message
    # It was never counted on: a send goes through without it.
    sender.send(WeightSet(1, _weights()), timeout=T)


def _raw_client(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=T)
    sock.settimeout(T)
    return sock


def test_strangers_and_bad_frames_cost_the_sender_nothing(made: list[Any]) -> None:
    """A client without the secret, one that sends an oversized or truncated frame, or one
    that connects and says nothing: each is refused or dropped, nothing is allocated for
    what a frame only claims, and the sender keeps serving its receivers."""
    transport = _transport(connect_timeout=scaled(2))
    made.append(transport)
    sender = transport.sender()
    port = sender.port
    threads_before = threading.active_count()

    # A forged JOIN: told why, in one line, then disconnected.
    sock = _raw_client(port)
    conn = wire.Conn(sock, server=False)
    kind, hello = conn.recv(Deadline(T), wire.HANDSHAKE_LIMIT)
    assert kind == wire.HELLO and bytes(hello).startswith(wire.MAGIC)
    conn.send_json(wire.JOIN, {"worker": "x", "nonce": "00" * 16, "tag": "00" * 32})
    kind, why = conn.recv(Deadline(T), wire.HANDSHAKE_LIMIT)
    assert kind == wire.REFUSE and b"secret" in why, (kind, why)
    assert sock.recv(1) == b"", "the sender should close the connection"
    sock.close()

    # A frame claiming a terabyte: refused from its header (no allocation), connection closed.
    sock = _raw_client(port)
    sock.recv(64)
    sock.sendall(struct.pack("!BQ", wire.JOIN, 2**40))
    assert sock.recv(1) == b""
    sock.close()

    # A truncated frame, then silence: dropped at the handshake's deadline, not held forever.
    sock = _raw_client(port)
    sock.recv(64)
    sock.sendall(struct.pack("!BQ", wire.JOIN, 100) + b"{")
    start = time.monotonic()
    assert sock.recv(1) == b""
    assert time.monotonic() - start < scaled(2) + scaled(5)
    sock.close()

    wait_until(
        lambda: threading.active_count() <= threads_before, scaled(10), "the stranger's threads to end"
    )
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    _sync(sender, [r], 1, _weights())


def _fake_sender(script: Any) -> tuple[int, threading.Thread, list[Any]]:
    """A sender speaking the wire protocol with the run's key, running ``script(conn)``
    after the handshake: it can say what a real sender never would."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    results: list[Any] = []

    def serve() -> None:
        sock, _ = listener.accept()
        listener.close()
        conn = wire.Conn(sock, server=True)
        try:
            wire.server_handshake(conn, wire.run_key("s" * 64), lambda: None, Deadline(T))
            results.append(script(conn))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results.append(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread, results


def _receiver(port: int) -> DeltaReceiver:
    options = DeltaTransport.Options(connect_timeout=scaled(10))
    return DeltaReceiver(options, "gen.0", "127.0.0.1", port, T, wire.run_key("s" * 64))


def _offer(
    rid: int, version: int, base: int | None, data: bytes, kind: int, payload: bytes
) -> dict[str, Any]:
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)
    return {"rid": rid, "version": version, "base": base, "base_digest": "ab" * 16 if base is not None else None,
            "block": 2**20, "tensors": [{"name": "w", "dtype": "uint8", "shape": [len(data)], "nbytes": len(data),
            "checksum": encoding.checksum(arr), "blocks": [[kind, len(data), len(payload)]]}]}  # fmt: skip


def test_a_delta_against_a_base_the_receiver_does_not_hold_is_refused_in_one_line(
    made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    data = bytes(range(256)) * 4

    def script(conn: wire.Conn) -> Any:
        kind, want = conn.recv_json(Deadline(T))
        assert kind == wire.WANT and want["base"] is None, want
        xz = encoding.compressor(1).compress(data)
        conn.send_json(wire.OFFER, _offer(want["rid"], 1, 5, data, encoding.XZ, xz))
        conn.send(wire.BLOCK, xz)
        conn.send_json(wire.END, {"rid": want["rid"]})
        kind, ack = conn.recv_json(Deadline(T))
        conn.send_json(wire.OFFER, _offer(want["rid"], 1, None, data, encoding.RAW, data))
        conn.send(wire.BLOCK, data)
        conn.send_json(wire.END, {"rid": want["rid"]})
        return ack, conn.recv_json(Deadline(T))[1]

    caplog.set_level(logging.WARNING)
    port, thread, results = _fake_sender(script)
    r = _receiver(port)
    made.append(r)
    got = dict(r.receive(1, timeout=T))
    assert bytes(got["w"].numpy()) == data
    thread.join(T)
    refused, accepted = results[0]
    assert (
        refused["ok"] is False and "against base 5" in refused["why"] and "holds no version" in refused["why"]
    )
    assert "\n" not in refused["why"]
    assert accepted["ok"] is True, accepted


def test_an_oversized_frame_from_the_sender_is_refused_without_allocating(made: list[Any]) -> None:
    def script(conn: wire.Conn) -> Any:
        conn.recv_json(Deadline(T))
        conn.sock.sendall(struct.pack("!BQ", wire.OFFER, 2**40))  # a terabyte, it says
        return conn.sock.recv(1)

    port, thread, results = _fake_sender(script)
    r = _receiver(port)
    made.append(r)
    with pytest.raises(TransportTimeout) as err:
        list(r.receive(1, timeout=scaled(3)))
    assert "at most" in str(err.value), str(err.value)
    thread.join(T)
    assert results == [b""], "the receiver should drop the connection"


def test_a_receiver_that_stops_reading_is_dropped_not_waited_for(made: list[Any]) -> None:
    """A receiver that asks, then reads nothing (a frozen process, a dead link): the sender's
    writes to it time out after stall_timeout and the send names it, while the other
    receiver gets the version."""
    transport = _transport(stall_timeout=1.0)
    made.append(transport)
    sender = transport.sender()
    good = transport.receiver("gen.good", transport.receiver_spec())
    made.append(good)
    sock = _raw_client(sender.port)
    made.append(sock)
    conn = wire.Conn(sock, server=False)
    wire.client_handshake(conn, wire.run_key(transport.secret()), "gen.frozen", Deadline(T))
    conn.send_json(wire.WANT, {"rid": 1, "version": 1, "base": None, "digest": None})
    g = torch.Generator().manual_seed(0)
    big = {"w": torch.randn(32 * 2**20 // 4, generator=g)}  # 32 MiB: more than socket buffers hold
    got: dict[str, Any] = {}
    taker = threading.Thread(target=lambda: got.update({n: t.clone() for n, t in good.receive(1, timeout=T)}))
    taker.start()
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        sender.send(WeightSet(1, big), timeout=T)
    took = time.monotonic() - start
    message = str(err.value)
    assert "'gen.frozen'" in message and "stalled" in message and "gen.good" not in message, message
    assert took < T, f"the send waited {took:.1f} s for a frozen receiver"
    taker.join(T)
    _same(got, big)


def test_latest_version_and_closed_receivers(made: list[Any]) -> None:
    transport = _transport()
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    assert r.latest_version() is None
    _sync(sender, [r], 3, _weights())
    assert r.latest_version() == 3
    with pytest.raises(ValueError):
        sender.send(WeightSet(3, _weights()), timeout=T)
    r.close()
    with pytest.raises(TransportError, match="closed"):
        r.receive(3, timeout=1)


def test_options_are_json_round_trippable() -> None:
    options = DeltaTransport.Options(port=1234, block_mb=8, level=3)
    assert DeltaTransport.Options(**json.loads(options.model_dump_json())) == options
    with pytest.raises(ValueError):
        DeltaTransport.Options(block_mb=0)


# ------------------------------------------------------------ seeded from the model's files


def _model_folder(path: Path, weights: dict[str, torch.Tensor], tied: bool = False) -> Path:
    """A Hugging Face-style folder holding ``weights`` (as a checkpoint would, in fp32: the
    receiver casts to what the sender sends); ``tied`` leaves ``lm_head.weight`` out."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    stored = {n: (t.float() if t.is_floating_point() else t).contiguous() for n, t in weights.items()}
    if tied:
        stored.pop("lm_head.weight")
    save_file(stored, str(path / "model.safetensors"))
    return path


def _seeded_transport(tmp_path: Path, folder: Path, **options: Any) -> DeltaTransport:
    from forgerl.interfaces import RunContext

    options.setdefault("block_mb", 1)
    options.setdefault("connect_timeout", scaled(10))
    context = RunContext(run_dir=tmp_path / "run", model_path=folder)
    return DeltaTransport(DeltaTransport.Options(**options), context=context)


def _seeded_receiver(
    made: list[Any], tmp_path: Path, trainer_folder: Path, receiver_folder: Path
) -> tuple[DeltaTransport, DeltaSender, DeltaReceiver]:
    """A sender that started from ``trainer_folder`` and one receiver told it loaded
    ``receiver_folder``."""
    transport = _seeded_transport(tmp_path, trainer_folder)
    made.append(transport)
    sender = transport.sender()
    r = transport.receiver("gen.0", transport.receiver_spec())
    made.append(r)
    r.seed_from(receiver_folder)
    return transport, sender, r


def test_a_new_receiver_gets_its_first_version_against_the_model_files(made: list[Any], tmp_path: Path) -> None:
    """The trainer and the generator started from the same folder: version 1 goes as a delta
    against the files on both sides (the output layer tied to the embedding, as Hugging Face
    saves it), bit-exact, far smaller than whole. The sender frees its copy of the files once
    every receiver holds a version, and reads them again for a receiver that joins later."""
    start = {**_weights(), "lm_head.weight": torch.zeros(1)}
    start["lm_head.weight"] = start["model.embed_tokens.weight"]
    folder = _model_folder(tmp_path / "model", start, tied=True)
    transport, sender, r = _seeded_receiver(made, tmp_path, folder, folder)
    one = _nudge(start, 0.01, seed=1)
    _sync(sender, [r], 1, one)
    (served,) = _served(sender, 1, "gen.0")
    full = sum(t.numel() * t.element_size() for t in one.values())
    assert not served.full and served.base == -1, served
    assert served.wire_bytes < full / 10, (served.wire_bytes, full)
    assert sender.seed_why == ""
    assert sender._files.version is None, "every receiver holds a version: the files' copy is freed"
    two = _nudge(one, 0.01, seed=2)
    late = transport.receiver("gen.1", transport.receiver_spec())
    made.append(late)
    late.seed_from(folder)
    _sync(sender, [r, late], 2, two)
    by_worker = {s.worker_id: s for s in sender.served[2]}
    assert by_worker["gen.0"].base == 1 and by_worker["gen.1"].base == -1, by_worker


def test_a_receiver_with_other_files_gets_the_version_whole(made: list[Any], tmp_path: Path) -> None:
    """Files that differ from the trainer's start by one element (another revision): the
    receiver refuses the delta in one line and the version comes whole, exact. Without a
    folder, or with ``seed: false``, it goes whole from the start."""
    start = _weights()
    ours = _model_folder(tmp_path / "trainer-model", start)
    other = dict(start)
    other["model.norm.weight"] = start["model.norm.weight"].clone()
    other["model.norm.weight"][7] += 1
    theirs = _model_folder(tmp_path / "generator-model", other)
    transport, sender, r = _seeded_receiver(made, tmp_path, ours, theirs)
    one = _nudge(start, 0.01, seed=1)
    _sync(sender, [r], 1, one)
    first, second = _served(sender, 1, "gen.0")
    assert first.base == -1 and second.full and "not the trainer's starting weights" in second.why_full, second
    assert "\n" not in second.why_full

    unseeded = transport.receiver("gen.1", transport.receiver_spec())  # never told its folder
    made.append(unseeded)
    off = _seeded_transport(tmp_path / "off", ours, seed=False)
    made.append(off)
    r_off = off.receiver("gen.2", off.receiver_spec())
    made.append(r_off)
    r_off.seed_from(ours)
    two = _nudge(one, 0.01, seed=2)
    _sync(sender, [r, unseeded], 2, two)
    assert {s.worker_id: s.full for s in sender.served[2]} == {"gen.0": False, "gen.1": True}
    _sync(off.sender(), [r_off], 1, one)
    (served,) = _served(off.sender(), 1, "gen.2")
    assert served.full, served


def test_receivers_connect_where_the_sender_is_advertised(made: list[Any]) -> None:
    """``advertise``: receivers are told a port forward's address, not the sender's own, and
    reach the sender through it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        forward = probe.getsockname()[1]
    transport = _transport(advertise=f"127.0.0.1:{forward}")
    made.append(transport)
    sender = transport.sender()
    spec = transport.receiver_spec()
    assert (spec["host"], spec["port"]) == ("127.0.0.1", forward) and forward != sender.port
    relay = socket.create_server(("127.0.0.1", forward))
    made.append(relay)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def accept() -> None:
        down, _ = relay.accept()
        up = socket.create_connection(("127.0.0.1", sender.port))
        for a, b in ((down, up), (up, down)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    r = transport.receiver("gen.0", spec)
    made.append(r)
    _sync(sender, [r], 1, _weights())
    assert [s.worker_id for s in sender.served[1]] == ["gen.0"]
    with pytest.raises(Exception, match="advertise"):
        DeltaTransport.Options(advertise="no-port-here")


def test_torn_model_files_cost_only_the_saving(tmp_path: Path) -> None:
    """A receiver whose model file is cut short (a partial download) cannot build the
    base: one reason, no exception; its version then comes whole."""
    from forgerl_plugins.transports.delta import seed

    start = _weights()
    folder = _model_folder(tmp_path / "model", start)
    snap = encoding.snapshot(1, iter(start.items()))
    built, why = seed.seed_version(folder, snap.infos)
    assert built is not None and why == ""
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    built, why = seed.seed_version(folder, snap.infos)
    assert built is None and "do not read" in why and "\n" not in why, why
    built, why = seed.seed_version(tmp_path / "nowhere", snap.infos)
    assert built is None and "no *.safetensors" in why, why
