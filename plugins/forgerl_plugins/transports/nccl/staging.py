"""Where the ``nccl`` sender broadcasts each chunk of a version from.

A chunk that is (part of) one tensor already on the channel's device goes from the
tensor's own memory; the others are packed into one of two staging buffers per device
(packing the next while the previous is on the wire). A buffer is repacked only once
every broadcast that reads it is done: :attr:`Staging.in_flight` keeps those, across
versions, and the sender retires a buffer whose broadcast to a dropped receiver may
still be pending (:meth:`Staging.retire`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from forgerl_plugins.transports.common.layout import Chunk, Layout, tensor_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: A staging buffer: (device, 0 or 1).
Slot = tuple[Hashable, int]


@dataclass
class Version:
    """The version a sender serves: its layout and the tensors it was built from."""

    layout: Layout
    tensors: list[torch.Tensor]
    #: Checksum of each chunk, made the first time the chunk is sent (while its
    #: broadcast is on the wire) and kept for the version's other deliveries.
    sums: list[int | None] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.layout.version

    @cached_property
    def offer(self) -> str:
        """The layout as JSON: the store's META value and every receiver's offer (made once)."""
        return self.layout.to_json()

    def chunk_sum(self, index: int) -> int:
        if not self.sums:
            self.sums = [None] * len(self.layout.chunks)
        known = self.sums[index]
        if known is None:
            known = self.sums[index] = self.layout.chunk_sum(index, self.tensors)
        return known


class Staging:
    def __init__(self) -> None:
        self.buffers: dict[Any, list[Any]] = {}
        #: Broadcasts started from each staging buffer and not yet known to be done,
        #: across deliveries (``(receiver, work)``): a dropped receiver's may still be pending.
        self.in_flight: dict[Slot, list[tuple[Any, Any]]] = {}

    @staticmethod
    def direct(current: Version, chunk: Chunk, device: Any) -> Any:
        """The bytes of ``chunk`` in its tensor's own memory, when it is (part of) one tensor
        already on ``device``; else None."""
        if len(chunk.entries) != 1:
            return None
        e = current.layout.entries[chunk.entries[0]]
        t = current.tensors[chunk.entries[0]]
        if t.device != device:
            return None
        return tensor_bytes(t)[chunk.start - e.offset : chunk.end - e.offset]

    def pack(self, current: Version, chunk: Chunk, device: Any, slot: int) -> Any:
        """``chunk`` copied into staging buffer ``slot`` of ``device``."""
        import torch

        layout = current.layout
        bufs = self.buffers.setdefault(device, [None, None])
        buf = bufs[slot]
        if buf is None or buf.numel() < chunk.nbytes:
            bufs[slot] = None  # free first: two of these may not fit on a GPU
            size = max(chunk.nbytes, max((c.nbytes for c in layout.chunks if len(c.entries) > 1), default=0))
            buf = bufs[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        layout.pack(chunk, current.tensors, buf, base=chunk.start)
        return buf[: chunk.nbytes]

    def retire(self, slot: Slot) -> None:
        """Never repack this buffer: a broadcast from it is still pending. The work keeps
        the buffer alive until it ends; a fresh buffer takes the slot."""
        bufs = self.buffers.get(slot[0])
        if bufs is not None:
            bufs[slot[1]] = None

    def synchronize(self) -> None:
        """Wait for the GPU work queued on the staging devices (NCCL's wait() does not
        block the CPU)."""
        for device in self.buffers:
            if getattr(device, "type", "cpu") == "cuda":
                import torch

                torch.cuda.current_stream(device).synchronize()

    def clear(self) -> None:
        self.buffers.clear()
        self.in_flight.clear()
