"""The delta transport's encoding: a version against a base, in blocks, back to the exact bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forgerl_plugins.transports.delta import encoding
from forgerl_plugins.transports.delta.encoding import RAW, SPARSE, XZ

BLOCK = 4096


def _bytes(t: torch.Tensor) -> np.ndarray:
    return encoding.tensor_bytes(t, copy=True)


def _roundtrip(new: torch.Tensor, base: torch.Tensor) -> tuple[np.ndarray, list[encoding.Block]]:
    """Encode ``new`` against ``base`` and apply it to a copy of the base's bytes."""
    n, b = _bytes(new), _bytes(base)
    width = encoding.SPARSE_WIDTHS.get(encoding.dtype_name(new.dtype))
    blocks = encoding.delta_blocks(n, b, BLOCK, encoding.compressor(1), width)
    target, dec, off = b.copy(), encoding.decompressor(), 0
    for blk in blocks:
        encoding.apply_block(target, off, blk.kind, blk.raw_len, bytes(blk.payload), dec, width)
        off += blk.raw_len
    assert off == n.size, f"blocks cover {off} of {n.size} bytes"
    return target, blocks


def _sparse_change(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.reshape(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
    if out.dtype == torch.bool:
        flat[idx] = ~flat[idx]
    elif out.dtype.is_floating_point:
        flat[idx] = flat[idx] + torch.randn(idx.numel(), generator=g).to(out.dtype)
    else:
        flat[idx] = flat[idx] + 1
    return out


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32, torch.bool]
)
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.5])
def test_random_sparse_changes_round_trip_exactly(dtype: torch.dtype, fraction: float) -> None:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        base = torch.rand(300, 77, generator=g) > 0.5
    elif dtype.is_floating_point:
        base = torch.randn(300, 77, generator=g).to(dtype)
    else:
        base = torch.randint(-1000, 1000, (300, 77), generator=g, dtype=dtype)
    new = _sparse_change(base, fraction, seed=1)
    got, blocks = _roundtrip(new, base)
    assert np.array_equal(got, _bytes(new)), f"{dtype} at {fraction}: bytes differ after applying"
    assert encoding.checksum(got) == encoding.checksum(_bytes(new))
    size = sum(b.wire_len for b in blocks)
    if fraction <= 0.01:
        assert size < _bytes(new).size / 5, (
            f"{dtype}: {size} bytes for {fraction:.1%} changed of {_bytes(new).size}"
        )


def test_no_change_costs_almost_nothing_and_all_change_falls_back_to_raw() -> None:
    base = torch.randn(1000, 1000).to(torch.bfloat16)
    _, same = _roundtrip(base.clone(), base)
    assert all(b.kind == SPARSE for b in same)
    assert sum(b.wire_len for b in same) < 0.01 * base.numel() * 2, (
        "an unchanged tensor should cost ~nothing (a few bytes per block)"
    )

    # Every byte changed at random: nothing to compress.
    base = torch.randint(-(2**62), 2**62, (100_000,), dtype=torch.int64)
    other = torch.randint(-(2**62), 2**62, (100_000,), dtype=torch.int64)
    got, blocks = _roundtrip(other, base)
    assert np.array_equal(got, _bytes(other))
    # Random bytes do not compress: no block may cost more than its raw size.
    assert all(b.wire_len <= b.raw_len for b in blocks), [(b.kind, b.wire_len, b.raw_len) for b in blocks]
    assert any(b.kind == RAW for b in blocks)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.zeros(0, 4),
        torch.zeros(3, 0, dtype=torch.int64),
    ],
    ids=["0-d bf16", "0-d bool", "empty fp32", "empty int64"],
)
def test_zero_dim_and_empty_tensors(tensor: torch.Tensor) -> None:
    changed = tensor.clone()
    if changed.numel():
        changed.fill_(True) if changed.dtype == torch.bool else changed.add_(1)
    got, blocks = _roundtrip(changed, tensor)
    assert np.array_equal(got, _bytes(changed))
    assert len(blocks) == (1 if tensor.numel() else 0)


def test_a_block_that_promises_more_than_it_may_is_refused_before_decompressing() -> None:
    big = encoding.compressor(1).compress(bytes(10 * 2**20))  # 10 MiB of zeros in a few hundred bytes
    target = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(encoding.BlockError, match="declares"):
        encoding.apply_block(target, 0, XZ, BLOCK, big, encoding.decompressor())
    with pytest.raises(encoding.BlockError, match="past the tensor"):
        encoding.apply_block(target, BLOCK - 1, RAW, 2, b"ab", encoding.decompressor())
    with pytest.raises(encoding.BlockError, match="does not decompress"):
        encoding.apply_block(target, 0, XZ, BLOCK, b"not zstd at all", encoding.decompressor())
    with pytest.raises(encoding.BlockError, match="unknown block kind"):
        encoding.apply_block(target, 0, 7, 1, b"a", encoding.decompressor())
    assert not target.any(), "a refused block must not write"


def test_digest_names_the_exact_contents() -> None:
    weights = {"a": torch.randn(10).to(torch.bfloat16), "b": torch.arange(4)}
    one = encoding.snapshot(1, iter(weights.items()))
    again = encoding.snapshot(2, iter({k: v.clone() for k, v in weights.items()}.items()))
    assert one.digest == again.digest, "same bytes, same digest (the version number is not in it)"
    flipped = dict(weights)
    flipped["a"] = weights["a"].clone()
    flipped["a"].view(torch.int16)[3] ^= 1  # one bit
    assert encoding.snapshot(3, iter(flipped.items())).digest != one.digest
    renamed = {"A": weights["a"], "b": weights["b"]}
    assert encoding.snapshot(4, iter(renamed.items())).digest != one.digest


def _adam_first_step(base: torch.Tensor, lr: float = 1e-5) -> torch.Tensor:
    """What AdamW's first step does to bf16 weights kept as fp32 masters: every element
    moves by ``lr``; those small enough to notice change by a unit or two in the last place."""
    g = torch.Generator().manual_seed(3)
    master = base.float()
    return (master - lr * torch.sign(torch.randn(master.shape, generator=g))).to(base.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_floats_go_sparse_and_cost_less_than_their_xor(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = (0.02 * torch.randn(256, 512, generator=g)).to(dtype)
    new = _adam_first_step(base)
    share = (new != base).float().mean().item()
    assert 0.001 < share and (share < 0.9 or dtype == torch.float32), "bf16/fp16: a few change; fp32: all"
    got, blocks = _roundtrip(new, base)
    assert np.array_equal(got, _bytes(new))
    assert {b.kind for b in blocks} == {SPARSE}
    n, b = _bytes(new), _bytes(base)
    xz = sum(x.wire_len for x in encoding.delta_blocks(n, b, BLOCK, encoding.compressor(1)))
    sparse = sum(x.wire_len for x in blocks)
    assert sparse < 0.8 * xz, f"{dtype}: sparse {sparse} bytes against xor {xz}"


def _sparse_payload(count: int, bitmap: bytes, values: bytes) -> bytes:
    import struct

    c = encoding.compressor(1)
    packed = c.compress(bitmap)
    return struct.pack("<QI", count, len(packed)) + packed + c.compress(values)


def test_a_hostile_sparse_block_is_refused_before_it_writes() -> None:
    elements = BLOCK // 2  # bf16
    one_change = bytes([0x80]) + bytes(elements // 8 - 1)  # element 0 changed
    target = np.zeros(BLOCK, dtype=np.uint8)
    dec = encoding.decompressor()
    good = _sparse_payload(1, one_change, b"\x02\x00")
    encoding.apply_block(target.copy(), 0, SPARSE, BLOCK, good, dec, 2)  # the well-formed one applies
    cases = {
        "claims": _sparse_payload(elements + 1, one_change, b""),
        "marks 1 changes, 2 promised": _sparse_payload(2, one_change, b"\x02\x00\x02\x00"),
        "declares 4 bytes, 2 promised": _sparse_payload(1, one_change, b"\x02\x00\x00\x00"),
        "declares 4352 bytes, 256 promised": _sparse_payload(1, one_change + bytes(4096), b"\x02\x00"),
        "shorter than its header": b"\x01",
        "does not decompress": b"\x01" + bytes(7) + b"\x04" + bytes(3) + b"garbage!",
    }
    for match, payload in cases.items():
        with pytest.raises(encoding.BlockError, match=match):
            encoding.apply_block(target, 0, SPARSE, BLOCK, payload, dec, 2)
    with pytest.raises(encoding.BlockError, match="elements of None bytes"):
        encoding.apply_block(target, 0, SPARSE, BLOCK, good, dec, None)  # an int64 tensor's block
    assert not target.any(), "a refused block must not write"
