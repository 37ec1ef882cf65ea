"""The flat layout the nccl and rdma transports share, and the sender's chunk sources:
whatever the tensors, moving every chunk's bytes into one buffer reproduces them exactly.
(Fast: no processes, no groups.)"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from forgerl_plugins.transports.common.layout import ALIGN, Layout, tensor_bytes
from forgerl_plugins.transports.nccl.staging import Staging, Version

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _deliver(tensors: list[tuple[str, torch.Tensor]], bucket: int, own: int) -> tuple[Layout, torch.Tensor]:
    """What a receiver ends up holding: every chunk's source bytes at its offsets."""
    layout = Layout.build(7, tensors, bucket, own)
    layout = Layout.from_json(layout.to_json())  # as the receiver gets it
    staging = Staging()
    current = Version(layout, [t for _, t in tensors])
    buffer = torch.full((max(layout.nbytes, 1),), 0xAB, dtype=torch.uint8)
    cpu = torch.device("cpu")
    for i, chunk in enumerate(layout.chunks):
        assert chunk.nbytes <= bucket, f"chunk {chunk} exceeds the bucket of {bucket} bytes"
        src = staging.direct(current, chunk, cpu)
        if src is None:
            src = staging.pack(current, chunk, cpu, i % 2)
        buffer[chunk.start : chunk.end].copy_(src)
    return layout, buffer


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12),
    bucket=st.sampled_from([8, 64, 100, 4096]),
    own=st.sampled_from([1, 16, 64, 10**9]),
)
def test_any_tensors_survive_layout_and_chunking_bit_exact(specs, bucket, own) -> None:
    tensors = [(f"model.layers.{i}.w", _tensor(shape, dtype, i)) for i, (shape, dtype) in enumerate(specs)]
    layout, buffer = _deliver(tensors, bucket, own)
    got = dict(layout.views(buffer))
    assert list(got) == [n for n, _ in tensors]
    for name, t in tensors:
        v = got[name]
        assert v.dtype == t.dtype and v.shape == t.shape, (name, v.dtype, v.shape, t.dtype, t.shape)
        assert torch.equal(tensor_bytes(v.contiguous()), tensor_bytes(t)), f"{name} differs"
    for e in layout.entries:
        assert e.offset % ALIGN == 0, f"{e.name} at {e.offset} is not {ALIGN}-byte aligned"


def test_big_tensors_go_from_their_own_memory_and_small_ones_are_packed() -> None:
    big = torch.arange(1000, dtype=torch.float32)  # 4000 bytes
    small = [torch.ones(3, dtype=torch.float16) * i for i in range(4)]
    tensors = [("a.0", small[0]), ("big", big), ("a.1", small[1]), ("a.2", small[2]), ("a.3", small[3])]
    layout = Layout.build(1, tensors, bucket_bytes=1024, own_chunk_bytes=512)
    big_chunks = [c for c in layout.chunks if c.entries == (1,)]
    assert len(big_chunks) == 4 and sum(c.nbytes for c in big_chunks) == 4000, big_chunks
    current = Version(layout, [t for _, t in tensors])
    src = Staging.direct(current, big_chunks[1], torch.device("cpu"))
    assert src is not None and src.data_ptr() == big.data_ptr() + 1024, (
        "a big tensor's chunk must not be copied"
    )
    packed = [c for c in layout.chunks if len(c.entries) > 1]
    assert [c.entries for c in packed] == [(2, 3, 4)], layout.chunks


def test_empty_and_zero_dim_tensors() -> None:
    tensors = [("e", torch.empty(0, 4)), ("z", torch.tensor(3.5)), ("b", torch.tensor(True))]
    layout, buffer = _deliver(tensors, 64, 64)
    got = dict(layout.views(buffer))
    assert (
        got["e"].shape == (0, 4)
        and got["z"].shape == ()
        and got["z"].item() == 3.5
        and got["b"].item() is True
    )


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        Layout.build(1, [("w", torch.ones(1)), ("w", torch.ones(1))], 64)


def test_unknown_dtype_in_a_layout_is_refused() -> None:
    text = Layout.build(1, [("w", torch.ones(2))], 64).to_json().replace("float32", "float99")
    with pytest.raises(ValueError, match="float99"):
        dict(Layout.from_json(text).views(torch.zeros(64, dtype=torch.uint8)))


def test_backends_are_registered_with_options() -> None:
    from forgerl.registry.plugins import build_registry

    registry = build_registry()
    nccl = registry.require("transport", "nccl")
    opts = nccl.validate_options({})
    assert opts.bucket_mb >= 1 and opts.connect_timeout > 0 and opts.timeout is None
    with pytest.raises(Exception, match="extra"):
        nccl.validate_options({"bukcet_mb": 4})
    rdma = registry.get("transport", "rdma")
    assert rdma.requires == ("mooncake",) and rdma.extra == "rdma"
    if rdma.unavailable_reason() is not None:
        assert "forgerl[rdma]" in rdma.unavailable_reason()
    else:
        assert rdma.validate_options({}).protocol == "rdma"
