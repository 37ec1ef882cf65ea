"""Per-chunk checksums of a weights layout (nccl/rdma ``layout.py``): what a receiver checks
before it acknowledges a version, so that bytes of another chunk or version (a torn
transfer, as a dropped receiver's pending broadcasts can make) are refused instead of loaded."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from forgerl_plugins.transports.common.layout import Layout, word_sum  # noqa: E402


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g)
    return [
        ("odd.bytes", base[3:16]),  # 13 bytes at a storage offset that is no multiple of 8
        ("small", torch.randn(7, generator=g)),
        ("empty", torch.empty(0)),
        ("scalar", torch.tensor(5, dtype=torch.int64)),
        ("big", torch.randn(3000, generator=g)),  # its own chunks, cut at bucket boundaries
    ]


def received(layout: Layout, ts: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The flat buffer a receiver ends up with; the gaps between tensors hold garbage."""
    buf = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    for e, (_, t) in zip(layout.entries, ts):
        buf[e.offset : e.end] = t.reshape(-1).view(torch.uint8)
    return buf


def test_a_whole_version_passes_and_the_sums_survive_the_offer() -> None:
    ts = tensors()
    layout = Layout.build(1, ts, 1024, 512).with_sums([t for _, t in ts])
    offered = Layout.from_json(layout.to_json())  # what the receiver parses
    assert offered.sums == layout.sums and len(offered.sums) == len(offered.chunks) > 2
    buf = received(offered, ts)
    assert all(offered.chunk_intact(i, buf) for i in range(len(offered.chunks)))


def test_any_changed_byte_fails_its_chunk_only() -> None:
    ts = tensors()
    layout = Layout.build(1, ts, 1024, 512).with_sums([t for _, t in ts])
    for i, chunk in enumerate(layout.chunks):
        for ix in chunk.entries:
            e = layout.entries[ix]
            lo, hi = max(e.offset, chunk.start), min(e.end, chunk.end)
            for pos in {lo, (lo + hi) // 2, hi - 1}:
                buf = received(layout, ts)
                buf[pos] ^= 0x10
                bad = [j for j in range(len(layout.chunks)) if not layout.chunk_intact(j, buf)]
                assert bad == [i], f"byte {pos} of {e.name!r} flipped: chunks {bad} failed, expected [{i}]"


def test_another_versions_bytes_are_refused() -> None:
    ts1 = tensors()
    ts2 = [(n, t + 1 if t.is_floating_point() else t) for n, t in ts1]
    layout = Layout.build(1, ts1, 1024, 512).with_sums([t for _, t in ts1])
    buf = received(layout, ts2)
    failed = [i for i in range(len(layout.chunks)) if not layout.chunk_intact(i, buf)]
    floats = {i for i, c in enumerate(layout.chunks) if any(ts1[ix][1].is_floating_point() for ix in c.entries)}
    assert set(failed) == floats, (failed, floats)


def test_word_sum_is_exact_modulo_2_64() -> None:
    ones = torch.full((17,), 0xFF, dtype=torch.uint8)  # two words of -1 and a 1-byte tail
    assert word_sum(ones) == (-1 - 1 + 0xFF) % 2**64
    assert word_sum(torch.empty(0, dtype=torch.uint8)) == 0


def test_a_layout_without_sums_checks_nothing_and_bad_counts_are_refused() -> None:
    ts = tensors()
    layout = Layout.build(1, ts, 1024, 512)
    assert layout.sums is None and layout.chunk_intact(0, torch.zeros(layout.nbytes, dtype=torch.uint8))
    text = layout.with_sums([t for _, t in ts]).to_json().replace('"sums":[', '"sums":[1,')
    with pytest.raises(ValueError, match="checksums"):
        Layout.from_json(text)


def test_an_nccl_receiver_refuses_a_version_whose_sums_do_not_match(monkeypatch, caplog) -> None:
    """The nccl sender sends each chunk's sum after the chunks; a receiver whose bytes do not
    match them never acknowledges or yields that version (the sender's sums for version 1
    are made wrong here), and takes the next good one bit-exact."""
    import threading

    from forgerl.errors import TransportError
    from forgerl.testing.transport_receiver import make_weights
    from forgerl.types import WeightSet
    from forgerl_plugins.transports.nccl.transport import NcclTransport
    from tests.helpers.timing import scaled, wait_until

    real = Layout.chunk_sum

    def wrong_for_version_1(self: Layout, index: int, ts: list) -> int:
        return (real(self, index, ts) + (index == 0 and self.version == 1)) % 2**64

    monkeypatch.setattr(Layout, "chunk_sum", wrong_for_version_1)
    transport = NcclTransport(NcclTransport.Options(backend="gloo", bucket_mb=1), context=None)
    sender = transport.sender()
    receiver = transport.receiver("w0")
    try:
        for version, must_arrive in ((1, False), (2, True)):
            weights = make_weights(version)
            got: dict = {}
            errors: list[BaseException] = []

            def receive(version: int = version, got: dict = got, errors: list = errors) -> None:
                try:
                    got.update((n, t.clone()) for n, t in receiver.receive(version, timeout=scaled(4)))
                except TransportError as exc:
                    errors.append(exc)

            thread = threading.Thread(target=receive)
            thread.start()
            try:
                sender.send(WeightSet(version, weights), timeout=scaled(4))
                sent = True
            except TransportError as exc:
                sent = False
                assert "w0" in str(exc), exc
            thread.join(scaled(30))
            assert not thread.is_alive()
            if must_arrive:
                assert sent and not errors, errors
                assert set(got) == set(weights)
                for name, t in weights.items():
                    assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            else:
                assert not sent and not got and errors, (sent, list(got), errors)
                # Until its receive gave up, the receiver registered again after each refusal
                # and was offered version 1 again. A send goes to the registrations the sender
                # holds when it starts; one that refused version 1 a moment before, unseen
                # yet, would make send(2) fail naming w0 (seen under load). So version 2 is
                # sent once the sender has seen every refusal: only the receiver's current
                # registration (if any) is left.
                def settled() -> bool:
                    with sender._cond:
                        live = [m.nonce for m in sender._members.values() if m.failed is None]
                    return all(n == receiver._nonce for n in live)

                wait_until(settled, 30, "the sender to drop every registration that refused version 1")
        assert "does not match the sender's checksum" in caplog.text
    finally:
        receiver.close()
        sender.close()
        transport.close()
