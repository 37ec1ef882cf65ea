"""The shm transport: versioned, atomic safetensors files that receivers poll for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from forgerl.configuration.config import RunConfig
from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import RunContext
from forgerl.types import WeightSet
from forgerl_plugins.transports.shm import transport as shm
from forgerl_plugins.transports.shm.transport import ShmTransport
from tests.helpers.timing import scaled, wait_until


def _transport(tmp_path: Path, **options) -> ShmTransport:
    options.setdefault("directory", str(tmp_path / "weights"))
    options.setdefault("poll_interval", 0.01)
    return ShmTransport(ShmTransport.Options(**options), context=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want), f"names/order differ: {list(got)} vs {list(want)}"
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{name}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        )
        assert torch.equal(_bits(g), _bits(w)), f"{name}: bytes differ"


def _mixed_tensors() -> dict[str, torch.Tensor]:
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.14159])
    embed = torch.randn(7, 5)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 3).to(torch.bfloat16),
        "model.norm.weight": torch.cat([special, torch.randn(10)]).to(torch.float16),
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: the same tensor under two names
        "special.f32": special,
        "positions": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4),
        "mask.bool": torch.tensor([[True, False, True]]),
        "scalar.zero_d": torch.tensor(2.5),
        "empty.tensor": torch.empty(0, 3),
        "transposed": torch.randn(3, 6).t(),  # not contiguous
        "row.of.bigger": torch.randn(4, 4)[2],  # a view with an offset into a bigger buffer
    }


def test_roundtrip_is_bit_exact_across_dtypes_and_shapes(tmp_path):
    transport = _transport(tmp_path)
    tensors = _mixed_tensors()
    with transport.sender() as sender:
        sender.send(WeightSet(version=1, tensors=tensors))
        got = dict(transport.receiver("gen-0").receive(1, timeout=scaled(1)))
    _assert_bit_exact(got, tensors)
    written = {n: t for n, t in tensors.items() if n != "lm_head.weight"}  # the tie travels once
    assert sender.last_send_bytes == sum(t.numel() * t.element_size() for t in written.values())
    assert sender.last_send_seconds is not None and sender.last_send_seconds > 0


def test_a_tensor_under_two_names_is_written_once_and_received_as_one(tmp_path):
    """Tied embeddings: the file holds the matrix once; the receiver gives both names the
    same tensor, in the sender's order. A look-alike copy under another name is no tie."""
    from safetensors import safe_open

    embed, twin = torch.randn(6, 4), torch.randn(6, 4)
    tensors = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.randn(4),
        "lm_head.weight": embed,
        "twin.a": twin,
        "twin.b": twin.clone(),
        "reshaped": embed.view(4, 6),  # the same memory seen another way: its own tensor
    }
    transport = _transport(tmp_path)
    with transport.sender() as sender:
        sender.send(WeightSet(version=1, tensors=tensors))
        with safe_open(str(shm.version_file(sender.directory, 1)), framework="pt") as f:
            assert sorted(f.keys()) == sorted(n for n in tensors if n != "lm_head.weight")
        got = list(transport.receiver("gen-0").receive(1, timeout=scaled(1)))
    assert [n for n, _ in got] == list(tensors)
    received = dict(got)
    _assert_bit_exact(received, tensors)
    assert received["lm_head.weight"] is received["model.embed_tokens.weight"]
    assert received["twin.a"] is not received["twin.b"]
    assert received["reshaped"].data_ptr() != received["model.embed_tokens.weight"].data_ptr()


def test_received_tensors_outlive_their_file(tmp_path):
    transport = _transport(tmp_path, keep_versions=1)
    sender = transport.sender()
    sender.send(WeightSet(1, {"w": torch.full((1000,), 1.0)}))
    got = dict(transport.receiver("gen-0").receive(1, timeout=scaled(1)))
    sender.send(WeightSet(2, {"w": torch.full((1000,), 2.0)}))
    assert not shm.version_file(transport.directory, 1).exists(), "keep_versions=1 should remove v1"
    assert torch.equal(got["w"], torch.full((1000,), 1.0)), "tensor changed after its file was removed"
    sender.close()


def test_versions_must_strictly_increase(tmp_path):
    transport = _transport(tmp_path)
    with transport.sender() as sender:
        sender.send(WeightSet(3, {"w": torch.zeros(2)}))
        for bad in (3, 2):
            with pytest.raises(ValueError, match=f"got {bad} after 3"):
                sender.send(WeightSet(bad, {"w": torch.ones(2)}))
        sender.send(WeightSet(4, {"w": torch.ones(2)}))
        assert transport.receiver("gen-0").latest_version() == 4


def test_failed_write_leaves_previous_version_and_no_partial_file(tmp_path, monkeypatch):
    transport = _transport(tmp_path)
    sender = transport.sender()
    sender.send(WeightSet(1, {"w": torch.ones(64)}))

    real_write = shm._write_file

    def write_half_then_fail(tensors, path, metadata):
        real_write(tensors, path, metadata)
        with open(path, "r+b") as f:  # a crash half-way through the data
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm, "_write_file", write_half_then_fail)
    with pytest.raises(TransportError, match="could not write weights version 2"):
        sender.send(WeightSet(2, {"w": torch.full((64,), 2.0)}))
    leftovers = sorted(os.listdir(transport.directory))
    assert leftovers == ["LATEST", "v00000001.safetensors"], f"partial or temp files left: {leftovers}"

    receiver = transport.receiver("gen-0")
    assert receiver.latest_version() == 1
    assert torch.equal(dict(receiver.receive(1, timeout=scaled(1)))["w"], torch.ones(64))
    with pytest.raises(TransportTimeout):
        receiver.receive(2, timeout=0.05)

    # The failed version was not recorded: the trainer may retry it.
    monkeypatch.setattr(shm, "_write_file", real_write)
    sender.send(WeightSet(2, {"w": torch.full((64,), 2.0)}))
    assert torch.equal(dict(receiver.receive(2, timeout=scaled(1)))["w"], torch.full((64,), 2.0))
    sender.close()


def test_reader_never_sees_a_partial_version(tmp_path):
    transport = _transport(tmp_path, keep_versions=3)
    sender = transport.sender()
    receiver = transport.receiver("gen-0")
    seen: list[int] = []
    errors: list[BaseException] = []

    def read_all() -> None:
        try:
            for v in range(1, 11):
                got = dict(receiver.receive(v, timeout=scaled(10)))
                assert torch.equal(got["w"], torch.full((50_000,), float(v))), f"version {v} torn"
                seen.append(v)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    reader = threading.Thread(target=read_all)
    reader.start()
    for v in range(1, 11):
        # The sender keeps 3 versions: version v removes v - 3, so the reader must have
        # opened v - 3 first, whatever the machine's load (it was paced by a 20 ms sleep,
        # and a reader held up for three of them found its version gone). Waiting for it
        # to have read v - 2 still leaves it reading v - 1, or waiting for v while v is
        # written: the writes it must never see half-done.
        wait_until(lambda v=v: len(seen) >= v - 2 or errors, 30, f"the reader to read version {v - 2}")
        sender.send(WeightSet(v, {"w": torch.full((50_000,), float(v))}))
    reader.join(scaled(20))
    assert not reader.is_alive(), f"the reader is still waiting; it saw {seen}"
    sender.close()
    assert not errors, errors
    assert seen == list(range(1, 11))


def test_old_versions_are_removed_and_asking_for_one_says_so(tmp_path):
    transport = _transport(tmp_path, keep_versions=2)
    with transport.sender() as sender:
        for v in range(1, 5):
            sender.send(WeightSet(v, {"w": torch.full((3,), float(v))}))
        files = sorted(p.name for p in transport.directory.glob("*.safetensors"))
        assert files == ["v00000003.safetensors", "v00000004.safetensors"], files
        receiver = transport.receiver("gen-0")
        assert receiver.latest_version() == 4
        with pytest.raises(TransportError, match="version 1 is no longer .* version 4 replaced it"):
            receiver.receive(1, timeout=scaled(5))
        assert torch.equal(dict(receiver.receive(3, timeout=scaled(1)))["w"], torch.full((3,), 3.0))


def test_receive_timeout_gives_up_and_says_what_to_check(tmp_path):
    transport = _transport(tmp_path)
    sender = transport.sender()
    sender.send(WeightSet(1, {"w": torch.zeros(1)}))
    receiver = transport.receiver("gen-0")
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as info:
        receiver.receive(7, timeout=0.2)
    elapsed = time.monotonic() - start
    # It waited its timeout and gave up then, rather than waiting on (a hang).
    assert elapsed >= 0.2, f"gave up after {elapsed:.2f} s, before its 0.2 s timeout"
    assert elapsed < scaled(5), f"a 0.2 s timeout took {elapsed:.2f} s"
    message = str(info.value)
    assert "\n" not in message
    for part in (
        "version 7",
        str(transport.directory),
        "0.2 s",
        "newest there: 1",
        "is the trainer running?",
    ):
        assert part in message, f"{part!r} missing from {message!r}"
    sender.close()


def test_receiver_waits_for_a_version_sent_later(tmp_path):
    transport = _transport(tmp_path)
    sender = transport.sender()
    timer = threading.Timer(0.2, lambda: sender.send(WeightSet(1, {"w": torch.ones(2)})))
    timer.start()
    got = dict(transport.receiver("gen-0").receive(1, timeout=scaled(5)))
    timer.join()
    assert torch.equal(got["w"], torch.ones(2))
    sender.close()


def test_close_removes_everything_the_sender_wrote(tmp_path):
    # A directory the transport created is removed whole.
    owned = ShmTransport(ShmTransport.Options(poll_interval=0.01), context=None)
    sender = owned.sender()
    sender.send(WeightSet(1, {"w": torch.ones(4)}))
    receiver = owned.receiver("gen-0")
    list(receiver.receive(1, timeout=scaled(1)))
    receiver.close()
    assert shm.version_file(owned.directory, 1).exists(), "a receiver's close must not remove files"
    sender.close()
    sender.close()  # idempotent
    assert not owned.directory.exists(), f"{owned.directory} left behind"

    # A directory the user named: our files go; theirs stay, and so does the directory.
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    transport = _transport(tmp_path, directory=str(user_dir))
    with transport.sender() as sender:
        sender.send(WeightSet(1, {"w": torch.ones(4)}))
    assert sorted(os.listdir(user_dir)) == ["notes.txt"]


def test_a_new_sender_clears_versions_left_by_a_crashed_run(tmp_path):
    transport = _transport(tmp_path)
    transport.sender().send(WeightSet(5, {"w": torch.ones(1)}))  # never closed: a crash
    fresh = _transport(tmp_path).sender()
    assert fresh.last_version is None
    assert _transport(tmp_path).receiver("gen-0").latest_version() is None, "stale v5 would be served"
    fresh.send(WeightSet(1, {"w": torch.zeros(1)}))
    fresh.close()


def test_receiver_in_another_process_needs_the_spec(tmp_path):
    transport = _transport(tmp_path)
    spec = json.loads(json.dumps(transport.receiver_spec()))  # what crosses a process boundary
    remote = ShmTransport(ShmTransport.Options(), context=None)
    assert remote.receiver("gen-1", spec).directory == transport.directory
    with pytest.raises(TransportError, match="receiver_spec"):
        remote.receiver("gen-1")


def test_default_directory_is_shared_memory_else_the_run_dir(tmp_path, monkeypatch):
    ctx = RunContext.for_run(RunConfig(), tmp_path / "run")
    if shm.SHM_ROOT.is_dir():
        t = ShmTransport(ShmTransport.Options(), context=ctx)
        assert t.directory.parent == shm.SHM_ROOT and t.directory.name.startswith("forgerl-")
        t.close()
        assert not t.directory.exists()
    monkeypatch.setattr(shm, "SHM_ROOT", tmp_path / "no-shm-here")
    t = ShmTransport(ShmTransport.Options(), context=ctx)
    assert t.directory == tmp_path / "run" / "weights"
    with t.sender() as sender:
        sender.send(WeightSet(1, {"w": torch.ones(1)}))
    assert not t.directory.exists()


_CHILD = """
import json, sys, torch
from forgerl_plugins.transports.shm.transport import ShmTransport
spec = json.loads(sys.argv[1])
receiver = ShmTransport(ShmTransport.Options(poll_interval=0.01), context=None).receiver("gen-9", spec)
got = dict(receiver.receive(2, timeout=float(sys.argv[2])))
print(json.dumps({k: v.double().sum().item() for k, v in got.items()}))
"""


@pytest.mark.integration
def test_receiver_in_another_process_gets_the_version(tmp_path):
    transport = _transport(tmp_path)
    sender = transport.sender()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(transport.receiver_spec()), str(scaled(60))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sender.send(WeightSet(1, {"a": torch.ones(10)}))
    sender.send(WeightSet(2, {"a": torch.full((10,), 3.0), "b.c": torch.arange(4)}))
    out, err = child.communicate(timeout=scaled(90))
    sender.close()
    assert child.returncode == 0, err
    assert json.loads(out) == {"a": 30.0, "b.c": 6.0}
