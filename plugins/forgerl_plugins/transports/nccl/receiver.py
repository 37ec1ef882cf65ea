"""The ``nccl`` transport's receiver (in a generator worker): see :mod:`.transport` for
the shape.

It asks the sender for the next version (a ``want`` with a sequence number), forms its
channel (a two-rank process group with the sender) the first time the sender accepts it,
and receives the version's chunks into one buffer it reuses, checking each against the
checksums in the signed offer. It acknowledges only a version it holds whole and that the
sender still counts on; anything else breaks the channel, and the next attempt registers
afresh.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from forgerl_plugins.transports.common import control
from forgerl_plugins.transports.common.auth import signed_store
from forgerl_plugins.transports.common.control import (
    MAX_QUERY,
    STORE_ERRORS,
    Backoff,
    Control,
    Deadline,
    short,
)
from forgerl_plugins.transports.common.endpoints import StoreReceiver
from forgerl_plugins.transports.common.layout import Layout
from forgerl_plugins.transports.common.membership import EVENTS, member_key
from forgerl_plugins.transports.nccl import groups
from forgerl_plugins.transports.nccl.protocol import (
    NAMESPACE,
    WITHDRAWN,
    accept_key,
    group_prefix,
    offer_key,
    sums_key,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl_plugins.transports.nccl.options import Options

log = logging.getLogger(__name__)

#: For this long after asking for a version, look for the offer every 0.5 ms.
FAST_LOOKS_SECONDS = 0.01


class _ChannelBroken(Exception):
    pass


class _TornTransfer(Exception):
    """Bytes that landed are not the ones the sender's checksums describe."""


class NcclReceiver(StoreReceiver):
    name = "nccl"
    namespace = NAMESPACE

    def __init__(
        self, options: Options, worker_id: str, host: str, port: int, timeout: float, secret: str
    ) -> None:
        super().__init__(options, worker_id, host, port, timeout, secret)
        self._seq = 0
        self._want_sent = False
        self._pg: Any = None
        self._backend = ""
        self._register_now()

    def _receive(self, version: int, deadline: Deadline) -> Iterator[tuple[str, torch.Tensor]]:
        last_error = "no version offered"
        while True:
            if deadline.expired:
                raise self._timed_out(version, deadline, last_error)
            try:
                if self._nonce is None:
                    self._register(deadline)
                layout = self._take_one(deadline)
            except _ChannelBroken as exc:
                last_error = str(exc)
                if isinstance(exc.__cause__, _TornTransfer):  # never expected: say so loudly
                    log.warning("nccl receiver %s: refused a torn version: %s", self.worker_id, exc)
                self._abandon(last_error)
                deadline.sleep(self.options.poll_interval)
                continue
            except STORE_ERRORS as exc:
                last_error = f"sender unreachable: {short(exc)}"
                self._abandon(last_error)
                self._ctl = None
                deadline.sleep(0.25)
                continue
            if layout is None:
                last_error = "no version offered"
                continue
            if layout.version == version:
                return layout.views(self._buffer)
            if layout.version > version:
                raise self._superseded(version, layout.version, "the sender only serves its newest version")
            # An older version (we asked ahead of the trainer): keep waiting for ours.

    # --------------------------------------------------------------- internals

    def _register(self, deadline: Deadline) -> None:
        super()._register(deadline)
        self._seq, self._want_sent = 0, False

    def _take_one(self, deadline: Deadline) -> Layout | None:
        """Ask for the next version and receive what the sender offers; None when nothing
        was offered before the deadline (the request is withdrawn)."""
        ctl, nonce, seq = self._ctl, self._nonce, self._seq
        assert ctl is not None and nonce is not None
        if not self._want_sent:
            ctl.push(EVENTS, {"type": "want", "nonce": nonce, "seq": seq}, deadline)
            self._want_sent = True
        offered = offer_key(nonce, seq)
        offer: bytes | str | None = None
        backoff = Backoff(self.options.poll_interval)
        # The answer to a request usually comes within a millisecond or two (the sender
        # sees the request at its next look, then offers): look every 0.5 ms for that
        # long, instead of backing off to 4-8 ms sleeps that saw it up to 2 ms late.
        # And the first look for a drop is a poll interval away: one round trip less
        # before the version starts (it only matters when waiting long).
        asked = time.monotonic()
        next_closed_check = asked + self.options.poll_interval
        while not deadline.expired:
            if time.monotonic() >= next_closed_check:  # rarely: it only matters when waiting long
                dropped = self._dropped(ctl, deadline)
                if dropped is not None:
                    raise _ChannelBroken(dropped)
                next_closed_check = time.monotonic() + self.options.poll_interval
            if self._pg is None:
                accept = ctl.get_json(accept_key(nonce), deadline)
                if accept is not None:
                    self._connect_channel(accept["backend"], deadline)
                    backoff.reset()
                    continue
            else:
                offer = ctl.get(offered, deadline)
                if offer is not None:
                    break
            if time.monotonic() - asked < FAST_LOOKS_SECONDS:
                deadline.sleep(Backoff.FLOOR)
            else:
                backoff.sleep(deadline)
        if offer is None:
            # Withdraw the request, unless the sender took it in the meantime.
            got = ctl.compare_set(offered, "", WITHDRAWN, Deadline(MAX_QUERY))
            if got == WITHDRAWN:
                self._seq, self._want_sent = seq + 1, False
                return None
            offer = got
            if self._pg is None:  # offered before our group formed: cannot take it
                raise _ChannelBroken("offered a version before the channel formed")
        layout = Layout.from_json(offer)
        self._receive_into_buffer(layout, deadline, ctl, sums_key(nonce, seq))
        # The sender may have dropped us while we were stopped (a frozen VM, a debugger):
        # it no longer counts on this transfer, so neither do we. What landed was checked
        # chunk by chunk, but a version the sender gave up on is not one to acknowledge.
        closed = ctl.get(member_key(nonce, "closed"), Deadline(MAX_QUERY))
        if closed is not None:
            self._held = None
            raise _ChannelBroken(f"dropped by the sender during version {layout.version}: {closed.decode()}")
        ctl.set(member_key(nonce, "ack"), str(seq), Deadline(MAX_QUERY))
        self._seq, self._want_sent = seq + 1, False
        return layout

    def _connect_channel(self, backend: str, deadline: Deadline) -> None:
        assert self._nonce is not None
        seconds = max(0.05, min(self.options.connect_timeout, deadline.remaining()))
        store = control.connect(self.host, self.port, seconds)
        prefixed = signed_store(store, group_prefix(self._nonce), self._signer)
        try:
            self._pg = groups.make_group(prefixed, 1, 2, backend, seconds, control.local_address(self.host))
        except Exception as exc:
            raise _ChannelBroken(f"could not form the group with the sender: {short(exc)}") from exc
        self._backend = backend

    def _receive_into_buffer(self, layout: Layout, deadline: Deadline, ctl: Control, sums_at: str) -> None:
        import torch

        device = groups.device_for(self._backend)
        if self._buffer is None or self._buffer.numel() < layout.nbytes or self._buffer.device != device:
            self._buffer = None  # free the old one first: two model-sized buffers may not fit
            self._buffer = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=device)
        self._held = None  # the buffer is about to change: nothing in it is whole now
        # A transfer that started is given at least a little time even at the deadline;
        # abandoning it half-way would break the channel for nothing.
        op_timeout = max(deadline.remaining(), 2.0)
        done = 0
        self.progress = (layout.version, 0, layout.nbytes)
        op_deadline = Deadline(op_timeout + 1.0)
        landed: list[int] = []
        sums: list[int] | None = None
        try:
            works = [
                (c, groups.broadcast(self._pg, self._buffer[c.start : c.end], 0, op_timeout))
                for c in layout.chunks
            ]
            for i, (c, w) in enumerate(works):
                if i == len(works) - 1 and not w.is_completed():
                    # The sender's sums are usually in the store by now: read them while
                    # the last chunk is on the wire, not after it (two round trips less
                    # between the last byte and the acknowledgement).
                    try:
                        sums = self._look_for_sums(ctl, sums_at, len(layout.chunks), op_deadline)
                    except STORE_ERRORS:
                        pass  # read again below, where a store error counts as it always did
                groups.wait(w, op_deadline, completes_when_done=not self._buffer.is_cuda)
                if self._buffer.is_cuda:
                    # NCCL's wait() only orders streams; the checksum must see the bytes.
                    torch.cuda.current_stream(self._buffer.device).synchronize()
                landed.append(layout.landed_sum(i, self._buffer))  # while the next chunks are on the wire
                done += c.nbytes
                self.progress = (layout.version, done, layout.nbytes)
        except Exception as exc:
            raise _ChannelBroken(
                f"transfer of version {layout.version} broke after {done} of {layout.nbytes} bytes: {short(exc)}"
            ) from exc
        if sums is None:
            sums = self._sender_sums(ctl, sums_at, len(layout.chunks), op_deadline)
        bad = [i for i, (got, want) in enumerate(zip(landed, sums)) if got != want]
        if bad:
            c = layout.chunks[bad[0]]
            torn = _TornTransfer(
                f"chunk {bad[0]} ({c.start}-{c.end}) does not match the sender's checksum (bytes of "
                f"another chunk or version landed there; {len(bad)} chunk(s) in all)"
            )
            raise _ChannelBroken(f"version {layout.version} refused: {torn}") from torn
        self._held = layout

    def _sender_sums(self, ctl: Control, key: str, count: int, deadline: Deadline) -> list[int]:
        """The sender's checksums of the chunks it broadcast (it writes them once every
        chunk's broadcast has started, so they are usually there when the last one lands)."""
        backoff = Backoff(self.options.poll_interval)
        while True:
            sums = self._look_for_sums(ctl, key, count, deadline)
            if sums is not None:
                return sums
            dropped = self._dropped(ctl, deadline)
            if dropped is not None:
                raise _ChannelBroken(f"dropped by the sender before its checksums came: {dropped}")
            if deadline.expired:
                raise _ChannelBroken(f"the sender's checksums did not come within {deadline.seconds:g} s")
            backoff.sleep(deadline)

    def _look_for_sums(self, ctl: Control, key: str, count: int, deadline: Deadline) -> list[int] | None:
        """The sender's checksums if they are in the store now, else None."""
        raw = ctl.get(key, deadline)
        if raw is None:
            return None
        sums = [int(x) for x in json.loads(raw)]
        if len(sums) != count:
            raise _ChannelBroken(f"the sender sent {len(sums)} checksums for {count} chunks")
        return sums

    def _abandon(self, reason: str) -> None:
        """Leave this channel: the next receive registers afresh."""
        holder, self._pg = [self._pg], None
        groups.destroy_soon(holder)  # a broken group's teardown may wait for its dead peer
        self._say_closed(f"receiver {self.worker_id}: {reason}")
        self._nonce = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pg is not None:
            holder, self._pg = [self._pg], None
            if not groups.destroy_all(holder, graceful=True, timeout=10):
                log.warning("nccl receiver %s: tearing down its group took over 10 s", self.worker_id)
        self._say_closed(f"receiver {self.worker_id} closed")
        self._ctl = None
        self._buffer = None
        self._held = None
