"""Where each tensor of one weights version lives in a single flat byte buffer.

A sender describes a version as a :class:`Layout` (names, dtypes, shapes, byte offsets) and
publishes it as JSON through the transport's control store; a receiver allocates (or
reuses) one buffer of ``layout.nbytes`` bytes, lets the bytes land in it, and hands out
views. Offsets are aligned so that every view is aligned for its dtype.

The buffer is moved in :class:`Chunk` s, byte ranges of at most a bucket: a collective per
chunk (``nccl``) or a read per chunk (``rdma``). A tensor of at least ``own_chunk_bytes``
gets chunks of its own, so a sender can send it from its own memory without packing it.
Both sides use the chunk list the sender published, so they always agree on sizes.

Each chunk has a checksum (:meth:`Layout.chunk_sum` from the tensors on the sender's side,
:meth:`Layout.landed_sum` from the flat buffer on the receiver's; a layout may carry them,
:meth:`Layout.with_sums`), which the receiver compares before it acknowledges: insurance
that the bytes that landed are this version's and nobody else's (a torn or mixed-up
transfer), not protection against tampering (docs/security.md). The ``nccl`` sender sends
its sums after the chunks, so that neither side holds bytes back from the wire to sum them.

Used by the ``nccl`` and ``rdma`` transports.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
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


def word_sum(data: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor: the sum modulo 2**64 of its 64-bit little-endian
    words, the last partial word zero-padded. Any change to a single word changes it, and
    two different versions' bytes agree by chance about once in 2**64. Unlike a CRC it is
    not order-sensitive within the range (chunks are checked one by one, so bytes cannot
    move between them unseen), but it runs at memory speed: zlib.crc32 took 365 ms per
    500 MB here and blake2b 650 ms. Wrapping is exact: addition modulo 2**64 does not
    depend on the order in which the words are added.

    CPU bytes are summed by numpy, on the calling thread with the GIL released: 27-40 ms
    per 500 MB. torch's sum fans out over its OpenMP threads, which on two cores shared
    with the transfer's own threads waited for each other: a receiver's checks of a
    500 MB version took 120-520 ms of its time that way (docs/performance.md)."""
    n = data.numel()
    whole = n - n % 8
    total = 0
    if whole:
        head = data[:whole]
        if head.device.type == "cpu":
            import numpy as np

            # numpy views need no alignment (an odd storage offset reads unaligned words).
            total = int(np.add.reduce(head.numpy().view(np.uint64), dtype=np.uint64))
        else:
            import torch

            if head.storage_offset() % 8:
                head = head.clone()  # int64 views need 8-byte aligned storage offsets
            total = int(head.view(torch.int64).sum())
    if whole < n:
        tail = bytes(data[whole:].cpu().tolist()) + bytes(8 - (n - whole))
        total += int.from_bytes(tail, "little", signed=True)
    return total % 2**64


@dataclass(frozen=True)
class Layout:
    version: int
    entries: tuple[Entry, ...]
    nbytes: int
    chunks: tuple[Chunk, ...]
    #: Per chunk, the sum modulo 2**64 of :func:`word_sum` over the bytes of its entries
    #: (not of the alignment gaps between them, which carry nothing); None when the sender
    #: made none.
    sums: tuple[int, ...] | None = None

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

    # ------------------------------------------------------------------ packing

    def _parts(self, chunk: Chunk) -> Iterator[tuple[int, int, int]]:
        """``(entry index, lo, hi)``: the bytes ``[lo, hi)`` of the flat buffer that
        ``chunk`` carries for each of its entries."""
        for ix in chunk.entries:
            e = self.entries[ix]
            yield ix, max(e.offset, chunk.start), min(e.end, chunk.end)

    def pack(self, chunk: Chunk, tensors: Sequence[torch.Tensor], dst: torch.Tensor, base: int = 0) -> None:
        """Copy the bytes ``chunk`` carries out of ``tensors`` (in entry order) into
        ``dst``, a 1-D uint8 tensor whose first byte stands for byte ``base`` of the flat
        buffer (0: ``dst`` is the whole buffer; ``chunk.start``: it holds the chunk only)."""
        for ix, lo, hi in self._parts(chunk):
            off = self.entries[ix].offset
            copy_bytes(dst[lo - base : hi - base], tensor_bytes(tensors[ix])[lo - off : hi - off])

    # ---------------------------------------------------------------- checksums

    def with_sums(self, tensors: Sequence[torch.Tensor]) -> Layout:
        """This layout with the checksum of every chunk, made from the tensors it describes
        (in entry order)."""
        return replace(self, sums=tuple(self.chunk_sum(i, tensors) for i in range(len(self.chunks))))

    def chunk_sum(self, index: int, tensors: Sequence[torch.Tensor]) -> int:
        """The checksum of chunk ``index``, from the tensors it carries (in entry order):
        the sender's side."""
        total = 0
        for ix, lo, hi in self._parts(self.chunks[index]):
            off = self.entries[ix].offset
            total += word_sum(tensor_bytes(tensors[ix])[lo - off : hi - off])
        return total % 2**64

    def landed_sum(self, index: int, buffer: torch.Tensor) -> int:
        """The checksum of chunk ``index`` as it landed in ``buffer`` (the flat buffer):
        the receiver's side. The alignment gaps between entries carry nothing and are
        not summed."""
        return sum(word_sum(buffer[lo:hi]) for _, lo, hi in self._parts(self.chunks[index])) % 2**64

    def chunk_intact(self, index: int, buffer: torch.Tensor) -> bool:
        """Whether the bytes of chunk ``index`` in ``buffer`` match the sender's checksum
        (True when the layout carries none)."""
        if self.sums is None:
            return True
        return self.landed_sum(index, buffer) == self.sums[index]

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
        d: dict = {
            "version": self.version,
            "nbytes": self.nbytes,
            "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries],
            "chunks": [[c.start, c.end, list(c.entries)] for c in self.chunks],
        }
        if self.sums is not None:
            d["sums"] = list(self.sums)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        d = json.loads(text)
        entries = tuple(Entry(n, dt, tuple(sh), off, nb) for n, dt, sh, off, nb in d["entries"])
        chunks = tuple(Chunk(s, e, tuple(ix)) for s, e, ix in d["chunks"])
        sums = d.get("sums")
        if sums is not None and len(sums) != len(chunks):
            raise ValueError(f"a weights layout with {len(chunks)} chunks carries {len(sums)} checksums")
        return cls(
            int(d["version"]), entries, int(d["nbytes"]), chunks, None if sums is None else tuple(map(int, sums))
        )


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
