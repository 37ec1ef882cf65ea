"""The ``rdma`` transport: receivers read each version from the sender's registered memory.

Shape (see docs/transports.md):

* The sender (trainer rank 0) owns a Mooncake TransferEngine and two registered buffers,
  *slots*. ``send(v)`` packs version ``v`` into the slot not holding the newest version
  (double buffering: the previous version stays readable and unchanged while receivers
  may still read it), then publishes ``{version, layout, session, address}`` as
  ``current`` in its control store (a ``TCPStore``; :mod:`..common.control`, shared with
  the ``nccl`` transport like registration, layout and the secret).
* A receiver polls ``current``, reads the version with one-sided
  ``batch_transfer_sync_read`` calls into its own registered buffer (reused across
  versions), checks that the slot still holds that version (a generation key the sender
  sets to ``writing:N`` before it overwrites a slot: a torn read is retried, never
  yielded), acknowledges it, and yields views of its buffer.
* ``send`` returns once every receiver that was registered when it started has
  acknowledged the version, or raises naming those that did not within the timeout (a
  dead receiver cannot be seen by one-sided reads; its silence is). A dropped receiver
  registers again by itself; a late one simply reads ``current``.

With ``protocol="rdma"`` Mooncake uses RDMA NICs where present and TCP where none exists,
so CI runs the production code path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import Transport
from forgerl.types import WeightSet
from forgerl_plugins.transports.common import membership
from forgerl_plugins.transports.common.auth import ForgedValue, Signer
from forgerl_plugins.transports.common.control import (
    MAX_QUERY,
    STORE_ERRORS,
    Backoff,
    Control,
    Deadline,
    local_address,
    sender_address,
    short,
)
from forgerl_plugins.transports.common.endpoints import StoreReceiver, StoreSender
from forgerl_plugins.transports.common.hosting import StoreHostedTransport
from forgerl_plugins.transports.common.layout import Layout
from forgerl_plugins.transports.common.membership import LATEST, SENDER_CLOSED, Member, member_key
from forgerl_plugins.transports.common.options import StoreHostedOptions
from forgerl_plugins.transports.rdma.engine import Engine

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

NAMESPACE = "forgerl/rdma/"
CURRENT = "current"  # the newest version: layout, session, address (its number: LATEST)
NOT_SIGNED = "its acknowledgement in the control store is not signed with the run's secret"


def _slot_key(slot: int) -> str:
    """Which version a slot holds ("N"), or "writing:N" while it is being replaced."""
    return f"slot/{slot}"


def _filled_key(slot: int) -> str:
    """How many bytes of the slot's version are in place (it is published before it is full)."""
    return f"filled/{slot}"


# ============================================================================ sender


@dataclass
class _Member(Member):
    acked: int = -1  # the newest version it acknowledged


class RdmaSender(StoreSender):
    name = "rdma"
    namespace = NAMESPACE
    member_class = _Member

    def __init__(
        self,
        options: RdmaTransport.Options,
        server: Any,
        store_host: str,
        port: int,
        timeout: float,
        release: Any,
        signer: Signer,
    ) -> None:
        super().__init__(options, server, store_host, port, timeout, release, signer)
        self._engine = Engine(sender_address(options.host), options.protocol, options.device_name)
        self._slots: list[Any] = [None, None]
        self._newest_slot: int | None = None

    @property
    def session(self) -> str:
        return self._engine.session

    @property
    def registered_bytes(self) -> int:
        return 0 if self._engine is None else self._engine.registered_bytes

    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        import torch

        start = time.perf_counter()
        deadline, version, tensors = self._prepare(weights, timeout)
        layout = Layout.build(version, tensors, self.options.chunk_mb * 2**20)
        # (No local reference to the store: an exception's frames would keep its port open.)
        slot = 0 if self._newest_slot is None else 1 - self._newest_slot
        # Readers of the old contents of this slot see the change and retry.
        self._ctl.set(_slot_key(slot), f"writing:{version}", deadline)
        buf = self._slots[slot]
        if buf is None or buf.numel() < layout.nbytes:
            if buf is not None:
                self._engine.unregister(buf)
            self._slots[slot] = buf = None
            buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
            self._engine.register(buf)
            self._slots[slot] = buf
        self._ctl.set(_filled_key(slot), "0", deadline)
        self._ctl.set(_slot_key(slot), str(version), deadline)
        offer = {
            "version": version,
            "session": self._engine.session,
            "address": buf.data_ptr(),
            "slot": slot,
            "layout": layout.to_json(),
        }
        self._ctl.set(CURRENT, json.dumps(offer), deadline)
        self._ctl.set(LATEST, str(version), deadline)  # what receivers poll (small)
        # Published before it is filled: receivers read each chunk as soon as it is packed
        # (``filled`` says how far), so packing and reading overlap.
        arrays = [t for _, t in tensors]
        for chunk in layout.chunks:
            layout.pack(chunk, arrays, buf)
            self._ctl.set(_filled_key(slot), str(chunk.end), deadline)
        self._ctl.set(_filled_key(slot), str(layout.nbytes), deadline)
        self._newest_slot = slot
        self.last_version = version
        self._collect_joins(deadline)
        targets = [m for m in self._members.values() if m.failed is None]
        self._wait_acks(targets, version, deadline)
        self.last_send_seconds = time.perf_counter() - start
        self.last_send_bytes = layout.nbytes
        failed = [m for m in targets if m.acked < version]
        if failed:
            for m in failed:
                self._drop(m)
            msg = membership.undelivered(version, targets, failed)
            timed_out = all(m.failed and m.failed.startswith("no acknowledgement") for m in failed)
            raise (TransportTimeout if timed_out else TransportError)(msg)

    def _collect_joins(self, deadline: Deadline) -> None:
        self._take_events(self._ctl, deadline)
        for nonce in [n for n, m in self._members.items() if m.failed is not None]:
            self._drop(self._members[nonce])

    def _wait_acks(self, targets: list[_Member], version: int, deadline: Deadline) -> None:
        waiting = list(targets)
        backoff = Backoff(self.options.poll_interval)
        while waiting:
            try:
                acks: list[bytes | None] = list(
                    self._ctl.get_many([member_key(m.nonce, "ack") for m in waiting], deadline)
                )
            except ForgedValue:  # someone overwrote an acknowledgement: find whose, drop them
                acks = [self._signed_ack(m, deadline) for m in waiting]
            still = []
            for m, ack in zip(waiting, acks):
                if ack is None:
                    m.failed = NOT_SIGNED
                    continue
                m.acked = max(m.acked, int(ack))
                if m.acked >= version:
                    continue
                try:
                    closed, took = membership.closed_since(self._ctl, m.nonce, version, deadline)
                except ForgedValue:  # a stranger overwrote its acknowledgement or closed key
                    m.failed = NOT_SIGNED
                    continue
                if took:
                    m.acked = max(m.acked, version)
                elif closed is None:
                    still.append(m)
                else:
                    m.failed = f"it gave up: {closed.decode()}"
            waiting = still
            if waiting and deadline.expired:
                for m in waiting:
                    m.failed = f"no acknowledgement of version {version} within {deadline.seconds:g} s"
                return
            if waiting:
                backoff.sleep(deadline)

    def _signed_ack(self, m: _Member, deadline: Deadline) -> bytes | None:
        try:
            return self._ctl.get(member_key(m.nonce, "ack"), deadline) or b"-1"
        except ForgedValue:
            return None

    def _drop(self, m: _Member) -> None:
        self._members.pop(m.nonce, None)
        log.warning("rdma: receiver %s dropped: %s", m.label(), m.failed)
        membership.say_closed(self._ctl, m.nonce, f"dropped by the sender: {m.failed}", Deadline(MAX_QUERY))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._ctl.delete([LATEST, CURRENT], Deadline(MAX_QUERY))
            for m in self._members.values():
                self._ctl.set(member_key(m.nonce, "closed"), SENDER_CLOSED, Deadline(MAX_QUERY))
        except STORE_ERRORS:
            pass
        self._members.clear()
        if self._engine is not None:
            self._engine.close()  # unregisters both slots
        self._engine = None  # type: ignore[assignment]
        self._slots = [None, None]
        self._ctl = None  # type: ignore[assignment]
        self._server = None
        if self._release is not None:
            self._release()


# ========================================================================== receiver


class RdmaReceiver(StoreReceiver):
    """Reads versions into one registered buffer it reuses (see :class:`StoreReceiver`)."""

    name = "rdma"
    namespace = NAMESPACE

    def __init__(
        self, options: RdmaTransport.Options, worker_id: str, host: str, port: int, timeout: float, secret: str
    ) -> None:
        super().__init__(options, worker_id, host, port, timeout, secret)
        self._engine: Engine | None = Engine(local_address(host), options.protocol, options.device_name)
        # Refused (wrong secret): closes, so that the engine's ports do not stay open.
        self._register_now()

    @property
    def registered_bytes(self) -> int:
        return 0 if self._engine is None else self._engine.registered_bytes

    def _receive(self, version: int, deadline: Deadline) -> Iterator[tuple[str, torch.Tensor]]:
        last_error = "not published yet"
        backoff = Backoff(self.options.poll_interval)
        next_closed_check = 0.0
        while not deadline.expired:
            try:
                if self._ctl is None or self._nonce is None:
                    self._register(deadline)
                ctl = self._ctl
                assert ctl is not None and self._nonce is not None
                if time.monotonic() >= next_closed_check:
                    if self._dropped(ctl, deadline) is not None:
                        self._nonce = None  # dropped by the sender: register again, then read
                        continue
                    next_closed_check = time.monotonic() + self.options.poll_interval
                latest = ctl.get(LATEST, deadline)
                if latest is None or int(latest) < version:
                    last_error = f"newest published version: {'none' if latest is None else int(latest)}"
                    backoff.sleep(deadline)
                    continue
                cur = ctl.get_json(CURRENT, deadline)
                if cur is None or int(cur["version"]) < version:
                    # Published in the wrong order is impossible from our sender: an old
                    # value put back by someone; read only what says it is this version.
                    last_error = "the published offer is older than the newest version"
                    backoff.sleep(deadline)
                    continue
                if int(cur["version"]) > version:
                    why = "the sender keeps only its newest version readable"
                    raise self._superseded(version, int(cur["version"]), why)
                error = self._read(ctl, cur, deadline)
                if error is None:
                    ctl.set(member_key(self._nonce, "ack"), str(version), deadline)
                    return self._held.views(self._buffer)  # type: ignore[union-attr]
                last_error = error
                deadline.sleep(self.options.poll_interval)
            except STORE_ERRORS as exc:
                last_error = f"sender unreachable: {short(exc)}"
                self._ctl, self._nonce = None, None
                deadline.sleep(0.25)
        raise self._timed_out(version, deadline, last_error)

    def _read(self, ctl: Control, cur: Mapping[str, Any], deadline: Deadline) -> str | None:
        """Read the published version into the buffer; an error string when it must be retried."""
        import torch

        version, slot = int(cur["version"]), int(cur["slot"])
        layout = Layout.from_json(cur["layout"])
        assert self._engine is not None
        if self._buffer is None or self._buffer.numel() < layout.nbytes:
            if self._buffer is not None:
                self._engine.unregister(self._buffer)
            self._buffer = None
            buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
            self._engine.register(buf)
            self._buffer = buf
        if ctl.get(_slot_key(slot), deadline) != str(version).encode():
            return f"version {version} is being replaced in the sender's memory"
        self._held = None  # the buffer is about to change
        self.progress = (version, 0, layout.nbytes)
        base, remote = self._buffer.data_ptr(), int(cur["address"])
        chunks, pos, done = layout.chunks, 0, 0
        backoff = Backoff(self.options.poll_interval)
        while pos < len(chunks):
            filled = int(ctl.get(_filled_key(slot), deadline) or 0)
            ready = [c for c in chunks[pos:] if c.end <= filled]
            if not ready:
                # ``filled`` may be another version's by now: a reader that stalled (a
                # frozen VM, SIGSTOP) while two sends went by finds its slot rewritten with
                # a smaller version and would wait for bytes that never come until its
                # deadline (120 s by default). The slot's generation says so at once.
                if ctl.get(_slot_key(slot), deadline) != str(version).encode():
                    return f"version {version} was replaced in the sender's memory while it was read"
                if deadline.expired:
                    return f"version {version} was still being packed by the sender"
                backoff.sleep(deadline)
                continue
            backoff.reset()
            rc = self._engine.read(
                cur["session"],
                [base + c.start for c in ready],
                [remote + c.start for c in ready],
                [c.nbytes for c in ready],
            )
            if rc != 0:
                return f"Mooncake read from {cur['session']} failed ({rc}): the sender may be gone"
            pos += len(ready)
            done = ready[-1].end
            self.progress = (version, done, layout.nbytes)
        # The slot may have been rewritten while we read (we were slower than two sends):
        # then what we hold is torn, and is not yielded.
        if ctl.get(_slot_key(slot), deadline) != str(version).encode():
            return f"version {version} was replaced in the sender's memory while it was read"
        self.progress = (version, layout.nbytes, layout.nbytes)
        self._held = layout
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._say_closed(f"receiver {self.worker_id} closed")
        self._ctl = None
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self._buffer = None
        self._held = None


# ========================================================================= transport


class RdmaTransport(StoreHostedTransport, Transport):
    """Factory ``RdmaTransport(options, *, context)``; same shape as the nccl transport: the
    trainer side hosts the control store, receivers get :meth:`receiver_spec`."""

    name = "rdma"
    description = "one-sided RDMA reads with a TCP fallback (Mooncake)"
    requires = ("mooncake",)
    extra = "rdma"

    class Options(StoreHostedOptions):
        """The store-hosted transports' options (host, port, timeouts, ...) and rdma's own."""

        protocol: Literal["rdma", "tcp"] = Field(
            "rdma", description="Mooncake protocol; rdma falls back to TCP by itself where no RDMA NIC exists."
        )
        device_name: str = Field(
            "", description="RDMA NIC(s) to use, e.g. mlx5_0 (empty: Mooncake discovers them)."
        )
        chunk_mb: int = Field(64, ge=1, description="Size of each read request of a batch, in MiB.")
    namespace = NAMESPACE

    sender_class = RdmaSender
    receiver_class = RdmaReceiver
