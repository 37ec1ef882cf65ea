"""The ``nccl`` transport's sender (trainer rank 0): see :mod:`.transport` for the shape.

It hosts the control store; a service thread registers receivers, forms a channel (a
two-rank process group) with each the first time it asks, and delivers the current
version to whoever asked: every chunk is broadcast on every channel that asked, from the
tensor's own memory or from one of two staging buffers per device. ``send`` publishes a
version and waits until every receiver registered at that moment has acknowledged it, or
failed, or the timeout passed. Where each chunk is broadcast from is :mod:`.staging`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.types import WeightSet
from forgerl_plugins.transports.common import membership
from forgerl_plugins.transports.common.auth import Signer, signed_store
from forgerl_plugins.transports.common.control import (
    STORE_ERRORS,
    Backoff,
    Control,
    Deadline,
    sender_address,
    short,
)
from forgerl_plugins.transports.common.endpoints import StoreSender
from forgerl_plugins.transports.common.layout import Layout
from forgerl_plugins.transports.common.membership import LATEST, SENDER_CLOSED, Member
from forgerl_plugins.transports.nccl import groups
from forgerl_plugins.transports.nccl.engine import EngineBoard
from forgerl_plugins.transports.nccl.protocol import (
    META,
    NAMESPACE,
    WITHDRAWN,
    accept_key,
    group_prefix,
    offer_key,
    sums_key,
)
from forgerl_plugins.transports.nccl.staging import Slot, Staging, Version

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.transports.nccl.options import Options

log = logging.getLogger(__name__)

#: Tensors at least this big are sent from their own memory (no packing copy); smaller
#: ones are packed into bucket-sized chunks. On two CPU cores a gloo broadcast cost each
#: side 0.1-0.25 ms of CPU beyond its bytes (500 MB as 477 ops of 1 MiB against 15 of
#: 32 MiB: +70 ms per side), and packing costs the sender about 0.1 ms per MiB: sending a
#: tensor on its own pays from about 3 MiB on (docs/performance.md, "Weight transports").
OWN_CHUNK_BYTES = 4 * 2**20


def smallest_chunk_last(layout: Layout) -> Layout:
    """``layout`` with its smallest chunk moved to the end of the chunk list (the order
    both sides broadcast in; the receiver follows the published list). What a receiver
    does after its last chunk lands (sum it, then acknowledge) is the tail every version
    waits for beyond the wire: a 26 MiB last chunk cost 1-1.5 ms of summing there, a
    2 MiB packed one 0.1 ms. Which bytes go in which chunk does not change."""
    chunks = list(layout.chunks)
    if len(chunks) < 2:
        return layout
    smallest = min(range(len(chunks)), key=lambda i: (chunks[i].nbytes, -i))  # the latest of equals
    chunks.append(chunks.pop(smallest))
    return replace(layout, chunks=tuple(chunks))


@dataclass
class _Member(Member):
    want_seq: int = -1  # the newest request it made
    offered_seq: int = -1  # the newest request the sender answered (or found withdrawn)
    delivered: int | None = None  # the newest version it acknowledged
    channel: Any = None  # the group
    backend: str = ""
    forming: bool = False


@dataclass
class _Delivery:
    """One ``send`` waiting for its targets."""

    version: int
    deadline: Deadline
    targets: list[_Member] = field(default_factory=list)


class NcclSender(StoreSender):
    name = "nccl"
    namespace = NAMESPACE
    member_class = _Member
    #: Set by the transport object: engines that receive broadcasts themselves (.engine).
    engines: EngineBoard | None = None

    def __init__(
        self,
        options: Options,
        server: Any,
        store_host: str,
        port: int,
        timeout: float,
        release: Any,
        signer: Signer,
    ) -> None:
        super().__init__(options, server, store_host, port, timeout, release, signer)
        self._address = sender_address(options.host)
        self._backend = groups.resolve_backend(options.backend)
        self._cond = threading.Condition()
        self._current: Version | None = None
        self._delivery: _Delivery | None = None
        self._staging = Staging()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by send(): serve now, not at the next poll
        self._thread = threading.Thread(target=self._serve, name="forge-nccl-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ send

    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        start = time.perf_counter()
        deadline, version, tensors = self._prepare(weights, timeout)
        bucket = self.options.bucket_mb * 2**20
        # No checksums here: the service thread sums each chunk while its broadcast is on the
        # wire and sends the sums after the last chunk (_deliver), instead of keeping every
        # byte from the wire for the time it takes to sum the version first.
        layout = smallest_chunk_last(Layout.build(version, tensors, bucket, OWN_CHUNK_BYTES))
        current = Version(layout, [t for _, t in tensors])
        with self._cond:
            self._ctl.set(META, current.offer, deadline)
            self._ctl.set(LATEST, str(version), deadline)
            self._current = current
            # Receivers that registered before this call are owed this version.
            self._handle_events(self._ctl, deadline)
            delivery = _Delivery(version, deadline, [m for m in self._members.values() if m.failed is None])
            # Engines that receive broadcasts themselves take it through the board (.engine).
            engines = self.engines.publish(version, tensors) if self.engines is not None else []
            self._delivery = delivery
            self.last_version = version
            self._cond.notify_all()
            self._wake.set()
            while not deadline.expired and not self._closed:
                if all(m.delivered == version or m.failed for m in delivery.targets):
                    break
                self._cond.wait(min(0.1, deadline.remaining()))
            self._delivery = None
            failed = [m for m in delivery.targets if m.failed and m.delivered != version]
            missing = [m for m in delivery.targets if not m.failed and m.delivered != version]
            for m in missing:
                m.failed = f"did not take version {version} within {deadline.seconds:g} s"
        board = self.engines
        engine_errors = board.wait(version, engines, time.monotonic() + deadline.remaining()) if board and engines else []
        self.last_send_seconds = time.perf_counter() - start
        self.last_send_bytes = layout.nbytes
        if self._closed:
            raise TransportError(f"nccl sender closed while sending version {version}")
        if failed or missing:
            msg = membership.undelivered(version, delivery.targets, failed + missing)
            raise (TransportError if failed else TransportTimeout)(msg)
        if engine_errors:
            raise TransportTimeout(f"nccl: weights version {version} did not reach every engine: {'; '.join(engine_errors)}")
        log.debug(
            "nccl: version %d (%.1f MiB) reached %d receiver(s)",
            version,
            layout.nbytes / 2**20,
            len(delivery.targets),
        )

    # ------------------------------------------------------------- membership

    def _handle_events(self, ctl: Control, deadline: Deadline | None = None) -> bool:
        """Apply queued join/want events (caller holds ``_cond``); whether there were any."""
        events = self._take_events(ctl, deadline)
        for ev in events:
            if ev.get("type") == "want":
                m = self._members.get(ev["nonce"])
                if m is not None:
                    m.want_seq = max(m.want_seq, int(ev["seq"]))
        self._cond.notify_all()
        return bool(events)

    # --------------------------------------------------------- service thread

    def _serve(self) -> None:
        ctl: Control | None = None
        backoff = Backoff(self.options.poll_interval)
        while not self._stop.is_set():
            try:
                if ctl is None:
                    ctl = self._connect()
                with self._cond:
                    if self._handle_events(ctl):
                        backoff.reset()
                    for m in self._members.values():
                        if (
                            m.failed is None
                            and m.channel is None
                            and not m.forming
                            and m.want_seq > m.offered_seq
                        ):
                            m.forming = True
                            threading.Thread(target=self._form, args=(m,), daemon=True).start()
                    current = self._current
                    batch = [
                        m
                        for m in self._members.values()
                        if m.failed is None
                        and m.channel is not None
                        and m.want_seq > m.offered_seq
                        and current is not None
                        and m.delivered != current.version
                    ]
                if batch and current is not None:
                    try:
                        self._deliver(ctl, current, batch)
                    except Exception as exc:  # a bug, or the store gone: fail them now, not at the timeout
                        for m in batch:
                            self._fail(m, f"delivery failed: {type(exc).__name__}: {short(exc)}")
                        raise
                    backoff.reset()
                self._reap(ctl)
            except Exception:
                if self._stop.is_set():
                    break
                log.exception("nccl sender: service loop error (continuing)")
                ctl = None
            if self._wake.wait(backoff.next()):
                self._wake.clear()
                backoff.reset()

    def _connect(self) -> Control:
        timeout = self.options.connect_timeout
        return Control.connect(self.store_host, self.port, NAMESPACE, timeout, self._signer)

    def _form(self, m: _Member) -> None:
        """Build the channel with ``m`` (blocks until it joins, or connect_timeout)."""
        # In one process both ranks would sit on one GPU, which NCCL refuses: gloo then.
        same_process = m.pid == os.getpid() and m.host == self._address
        backend = "gloo" if same_process else self._backend
        try:
            ctl = self._connect()
            ctl.set_json(accept_key(m.nonce), {"backend": backend})
            store = signed_store(ctl.raw, group_prefix(m.nonce), self._signer)
            pg = groups.make_group(store, 0, 2, backend, self.options.connect_timeout, self._address)
        except Exception as exc:  # noqa: BLE001 - any failure drops this receiver only
            with self._cond:
                m.forming = False
                m.failed = f"could not form its group: {type(exc).__name__}: {short(exc)}"
                self._cond.notify_all()
            return
        with self._cond:
            m.forming = False
            if m.failed is not None or self._stop.is_set():
                groups.destroy(pg, graceful=False)
                return
            m.channel, m.backend = pg, backend
            self._cond.notify_all()
        log.info("nccl: channel to %s formed (%s)", m.label(), backend)

    # ---------------------------------------------------------------- delivery

    def _deadline_for(self, m: _Member, version: int) -> Deadline:
        d = self._delivery
        if d is not None and d.version == version and any(t is m for t in d.targets):
            return d.deadline
        return Deadline(self.default_timeout)

    def _deliver(self, ctl: Control, current: Version, batch: list[_Member]) -> None:
        layout, version = current.layout, current.version
        with self._cond:
            deadlines = {m.nonce: self._deadline_for(m, version) for m in batch}
        offer = current.offer
        active: list[tuple[_Member, int]] = []
        for m in batch:
            seq = m.want_seq
            try:
                got = ctl.compare_set(offer_key(m.nonce, seq), "", offer, deadlines[m.nonce])
            except STORE_ERRORS as exc:
                self._fail(m, f"control store error: {short(exc)}")
                continue
            m.offered_seq = seq
            if got == WITHDRAWN:
                continue  # it stopped waiting before we answered; it will ask again
            active.append((m, seq))
        if not active:
            return
        progress = {m.nonce: time.monotonic() for m, _ in active}  # when a chunk of each last completed
        # Every chunk is broadcast on every active channel. A chunk that is (part of) one
        # tensor already on the device goes from the tensor's memory; the others are packed
        # into one of two staging buffers per device (packing the next while the previous
        # is on the wire), reused once every broadcast of it completed. A broadcast to a
        # dropped receiver may still be pending (a stalled process resumes and takes it):
        # its buffer is then retired, never repacked (see _claim).
        pending = self._staging.in_flight
        packed_count: dict[Any, int] = {}
        works: list[tuple[_Member, Any]] = []
        for index, chunk in enumerate(layout.chunks):
            by_device: dict[Any, list[_Member]] = {}
            for m, _ in active:
                if m.failed is None:
                    by_device.setdefault(groups.device_for(m.backend), []).append(m)
            for device, members in by_device.items():
                src = self._staging.direct(current, chunk, device)
                slot = None
                if src is None:
                    n = packed_count.get(device, 0)
                    packed_count[device] = n + 1
                    slot = (device, n % 2)
                    self._claim(slot, deadlines, progress)
                    src = self._staging.pack(current, chunk, device, n % 2)
                for m in members:
                    if m.failed is not None:
                        continue
                    try:
                        w = groups.broadcast(m.channel, src, 0, deadlines[m.nonce].remaining())
                    except Exception as exc:  # noqa: BLE001
                        self._fail(m, f"broadcast failed: {short(exc)}")
                        continue
                    (works if slot is None else pending.setdefault(slot, [])).append((m, w))
            # Summed from the tensors (not the staging buffer: a repack under a pending
            # broadcast must show) while this chunk is on the wire.
            current.chunk_sum(index)
        # Every chunk's broadcast has started: the sums go now, so that a receiver finds
        # them when its last chunk lands. Signed like the offer; the receiver checks what
        # landed against them before it acknowledges (docs/reliability.md).
        sums = json.dumps([current.chunk_sum(i) for i in range(len(layout.chunks))])
        for m, seq in active:
            if m.failed is None:
                try:
                    ctl.set(sums_key(m.nonce, seq), sums, deadlines[m.nonce])
                except STORE_ERRORS as exc:
                    self._fail(m, f"control store error: {short(exc)}")
        for ws in pending.values():
            works.extend(ws)
        self._wait_works(works, deadlines, progress)
        for slot in list(pending):  # what is left is a dropped receiver's: checked at the next pack
            pending[slot] = [(m, w) for m, w in pending[slot] if not w.is_completed()]
        self._staging.synchronize()
        # A finished broadcast on the root only means the bytes left; the receiver's
        # acknowledgement means they all arrived and it holds the version.
        waiting = [(m, seq) for m, seq in active if m.failed is None]
        sent = time.monotonic()
        backoff = Backoff(self.options.poll_interval)
        while waiting and not self._stop.is_set():
            still = []
            for m, seq in waiting:
                try:
                    closed = None
                    acked = membership.acknowledged(ctl, m.nonce, seq, deadlines[m.nonce])
                    if not acked:
                        closed, acked = membership.closed_since(ctl, m.nonce, seq, deadlines[m.nonce])
                except STORE_ERRORS as exc:
                    self._fail(m, f"control store error: {short(exc)}")
                    continue
                if acked:
                    with self._cond:
                        m.delivered = version
                        self._cond.notify_all()
                elif closed is not None:
                    self._fail(m, f"it gave up: {closed.decode()}")
                elif deadlines[m.nonce].expired or time.monotonic() - sent > self.options.stall_timeout:
                    self._fail(m, f"no acknowledgement of version {version} after its last chunk (dead?)")
                else:
                    still.append((m, seq))
            waiting = still
            if waiting:
                self._stop.wait(backoff.next())

    def _claim(self, slot: Slot, deadlines: dict[str, Deadline], progress: dict[str, float]) -> None:
        """Make staging buffer ``slot`` free to repack: wait for its broadcasts to live
        receivers, and retire it if one to a dropped receiver is still pending.

        Dropping a receiver does not cancel its broadcasts: a gloo send waiting on a
        stopped (SIGSTOP, frozen VM) peer goes on reading the buffer when the peer resumes,
        and a NCCL kernel may still be queued. Repacking the buffer under it would hand
        that receiver later chunks (or versions) as this one's. The work keeps the retired
        buffer alive until it ends or the dropped channel is torn down; a fresh buffer
        takes the slot."""
        works = self._staging.in_flight.pop(slot, [])
        self._wait_works(works, deadlines, progress)
        if any(not w.is_completed() for _, w in works):
            self._staging.retire(slot)
            log.info(
                "nccl: staging buffer %d retired: a broadcast from it to a dropped receiver is still pending",
                slot[1],
            )

    def _wait_works(
        self, works: list[tuple[_Member, Any]], deadlines: dict[str, Deadline], progress: dict[str, float]
    ) -> None:
        """Wait until every work is done or its receiver failed. A work that fails fails
        its receiver; so does its deadline, and so does a stall: no chunk of that
        receiver completed for ``stall_timeout`` seconds (``progress``: when one last
        did). A receiver that died before answering leaves gloo ops pending until their
        own timeout — the stall rule frees the others, who share the staging buffers."""
        waiting = [(m, w) for m, w in works if m.failed is None]
        wake = threading.Event()  # set as any of them completes
        for _, w in waiting:
            groups.on_done(w, wake)
        backoff = Backoff(self.options.poll_interval)
        # A gloo work (CPU tensors) completes its future when it is done: the event alone
        # wakes this wait (groups.finished), and the steps (a safety net, and the pace of
        # the deadline and stall checks) can be long. Steps from 0.5 ms woke the sender
        # 5-8 times per staging-buffer wait: 2.4 ms of its CPU per 500 MB version (1.2 ms
        # now), taken from the transfer's threads on two cores (docs/performance.md).
        by_future = all(m.backend == "gloo" for m, _ in waiting)
        if by_future:
            backoff = Backoff(0.05)
            backoff.current = backoff.ceiling
        while waiting:
            wake.clear()  # before looking: a completion after the look wakes the wait below
            still = []
            for m, w in waiting:
                if m.failed is not None:
                    continue
                if groups.finished(w, by_future):
                    try:
                        w.wait()  # returns at once; raises what the work raised
                        progress[m.nonce] = time.monotonic()
                    except Exception as exc:  # noqa: BLE001 - a dead or stuck peer
                        self._fail(m, f"transfer failed: {short(exc)}")
                elif deadlines[m.nonce].expired:
                    self._fail(m, "transfer timed out")
                elif time.monotonic() - progress[m.nonce] > self.options.stall_timeout:
                    self._fail(
                        m,
                        f"transfer stalled: no chunk completed for {self.options.stall_timeout:g} s (dead?)",
                    )
                else:
                    still.append((m, w))
            waiting = still
            if waiting:
                wake.wait(backoff.next())

    def _fail(self, m: _Member, reason: str) -> None:
        with self._cond:
            if m.failed is None:
                m.failed = reason
                log.warning("nccl: receiver %s dropped: %s", m.label(), reason)
            self._cond.notify_all()

    def _reap(self, ctl: Control) -> None:
        """Tear down the channels of dropped receivers and tell them (they re-register)."""
        with self._cond:
            dead = [m for m in self._members.values() if m.failed is not None and not m.forming]
            for m in dead:
                del self._members[m.nonce]
        for m in dead:
            holder, m.channel = [m.channel], None
            groups.destroy_soon(holder)  # never in this thread: it may wait for a dead peer
            membership.say_closed(ctl, m.nonce, f"dropped by the sender: {m.failed}")

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.warning("nccl sender: the service thread did not stop within 10 s")
        with self._cond:
            members = list(self._members.values())
            self._members.clear()
        for m in members:
            membership.say_closed(self._ctl, m.nonce, SENDER_CLOSED, Deadline(1.0))
        holder = []
        for m in members:
            holder.append(m.channel)
            m.channel = None
        if not groups.destroy_all(holder, graceful=True, timeout=10):
            log.warning(
                "nccl sender: tearing down its groups took over 10 s; left to finish in the background"
            )
        self._current = None
        self._staging.clear()
        self._ctl = None  # type: ignore[assignment]
        self._server = None
        if self._release is not None:
            self._release()  # the transport drops its reference: the store's port closes

