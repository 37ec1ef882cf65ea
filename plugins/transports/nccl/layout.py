"""Where each tensor of one weights version lives in a single flat byte buffer.

A sender describes a version as a :class:`Layout` (names, dtypes, shapes, byte offsets) and
publishes it as JSON through the transport's control store; a receiver allocates (or
reuses) one buffer of ``layout.nbytes`` bytes, lets the bytes land in it, and hands out
views. Offsets are aligned so that every view is aligned for its dtype.

The buffer is moved in :class:`Chunk` s, byte ranges of at most a bucket: a collective per
chunk (``nccl``) or a read per chunk (``rdma``). A tensor of at least ``own_chunk_bytes``
gets chunks of its own, so a sender can send it from its own memory without packing it.
Both sides use the chunk list the sender published, so they always agree on sizes.

Used by the ``nccl`` and ``rdma`` transports.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Byte alignment of every tensor in the flat buffer (a cache line; enough for any dtype).
ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in a weights layout")  # noqa: TRY004
    return dtype


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes (0-d, empty and bool tensors too)."""
    import torch

    assert t.is_contiguous(), f"tensor_bytes needs a contiguous tensor, got strides {t.stride()}"
    return t.detach().reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two 1-D uint8 tensors of one size. Between CPU tensors a
    plain single-threaded memmove: torch's copy fans out over its OpenMP threads, which on
    busy cores wait for each other (and for the transfer threads) and ran 2-3x slower."""
    assert dst.numel() == src.numel(), f"copy of {src.numel()} bytes into {dst.numel()}"
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())  # releases the GIL
    else:
        dst.copy_(src)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of the flat buffer, covering (parts of) ``entries``."""

    start: int
    end: int
    entries: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    version: int
    entries: tuple[Entry, ...]
    nbytes: int
    chunks: tuple[Chunk, ...]

    # ----------------------------------------------------------------- building

    @classmethod
    def build(
        cls,
        version: int,
        tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        own_chunk_bytes: int | None = None,
    ) -> Layout:
        assert bucket_bytes > 0, f"bucket_bytes must be positive, got {bucket_bytes}"
        own = bucket_bytes if own_chunk_bytes is None else min(own_chunk_bytes, bucket_bytes)
        entries: list[Entry] = []
        seen: set[str] = set()
        offset = 0
        for name, t in tensors:
            if name in seen:
                raise ValueError(f"weight name {name!r} appears twice in version {version}")
            seen.add(name)
            nbytes = t.numel() * t.element_size()
            offset = _align(offset)
            entries.append(Entry(name, dtype_name(t.dtype), tuple(int(s) for s in t.shape), offset, nbytes))
            offset += nbytes
        return cls(int(version), tuple(entries), offset, tuple(_chunks(entries, bucket_bytes, own)))

    # -------------------------------------------------------------- reading out

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into ``buffer`` (uint8, at least ``nbytes`` long), in order."""
        assert buffer.numel() >= self.nbytes, f"buffer of {buffer.numel()} bytes < layout {self.nbytes}"
        for e in self.entries:
            yield e.name, buffer[e.offset : e.end].view(dtype_of(e.dtype)).view(e.shape)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    # ------------------------------------------------------------- (de)serialise

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "nbytes": self.nbytes,
                "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries],
                "chunks": [[c.start, c.end, list(c.entries)] for c in self.chunks],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        d = json.loads(text)
        entries = tuple(Entry(n, dt, tuple(sh), off, nb) for n, dt, sh, off, nb in d["entries"])
        chunks = tuple(Chunk(s, e, tuple(ix)) for s, e, ix in d["chunks"])
        return cls(int(d["version"]), entries, int(d["nbytes"]), chunks)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _chunks(entries: Iterable[Entry], bucket: int, own: int) -> Iterator[Chunk]:
    """Greedy: small tensors share bucket-sized chunks; a tensor of ``own`` bytes or more is
    cut into bucket-sized chunks of its own. Empty tensors need no bytes and no chunk."""
    start: int | None = None
    end = 0
    members: list[int] = []
    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        if e.nbytes >= own:
            if start is not None:
                yield Chunk(start, end, tuple(members))
                start, members = None, []
            for s in range(e.offset, e.end, bucket):
                yield Chunk(s, min(s + bucket, e.end), (i,))
            continue
        if start is not None and e.end - start > bucket:
            yield Chunk(start, end, tuple(members))
            start, members = None, []
        if start is None:
            start = e.offset
        end = e.end
        members.append(i)
    if start is not None:
        yield Chunk(start, end, tuple(members))
