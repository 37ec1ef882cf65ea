"""The ``nccl`` transport: broadcasts over private process groups (NCCL on GPU, gloo on CPU).

Shape (see docs/transports.md for the full protocol):

* The sender (trainer rank 0) hosts a ``TCPStore``, the control channel. Receivers connect
  to it (``receiver_spec()`` carries its host and port), register with their worker id and
  a fresh nonce, and say when they want the next version. Data never goes through it.
* Each receiver gets its own two-rank group with the sender (rank 0) — a *channel* —
  formed through the control store (its rendezvous values signed: :mod:`.auth`) the
  first time it asks. Per-receiver
  groups keep failures apart: a receiver that dies breaks only its own channel (a NCCL
  communicator cannot drop a dead member), a restarted one forms a new channel without
  disturbing the others, and nothing ever touches the default group the trainer's FSDP and
  the engine use.
* A version is laid out in one flat buffer (:mod:`.layout`) and moved in bucket-sized
  chunks; each chunk is packed once (or sent from the tensor's own memory when it is one
  big tensor) and broadcast on every channel that asked. A receiver receives into one
  buffer that it reuses across versions and yields views of it after the last chunk and
  its acknowledgement: never a partial version. Before acknowledging it has checked every
  chunk against the checksums in the signed offer and that the sender did not drop it
  meanwhile; the sender never repacks a staging buffer a dropped receiver's broadcast may
  still read (docs/reliability.md, "Weight transport stalls").
* A service thread in the sender forms channels and serves requests, so a receiver that
  joins late (a restarted generator) gets the current version without waiting for the
  next ``send``. ``send`` publishes a version and waits until every receiver registered
  at that moment has acknowledged it, or failed, or the timeout passed; it then raises
  naming the receivers that did not get it. The others have it; later versions go to
  whoever is alive.

The sender keeps a reference to the tensors of the current version until the next
``send`` (late joiners need them): they must not be modified in place meanwhile — the
fsdp trainer's ``export_weights`` returns fresh tensors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import Transport, TransportReceiver, TransportSender
from forgerl.types import WeightSet
from forgerl_plugins.transports.nccl import control, groups
from forgerl_plugins.transports.nccl.auth import Signer, signed_store
from forgerl_plugins.transports.nccl.control import (
    STORE_ERRORS,
    Backoff,
    Control,
    Deadline,
    member_key,
    short,
)
from forgerl_plugins.transports.nccl.layout import Chunk, Layout, copy_bytes, tensor_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from forgerl_plugins.transports.nccl import NcclTransportOptions

log = logging.getLogger(__name__)

NAMESPACE = "forgerl/nccl/"
EVENTS = "events"  # queue of {"type": "join"|"want", ...} from receivers
LATEST = "latest"  # the newest published version
META = "meta"  # its layout (JSON), for tools that only watch the store
#: Tensors at least this big are sent from their own memory (no packing copy); smaller
#: ones are packed into bucket-sized chunks. Each gloo broadcast costs a handshake (about
#: 1 ms on a busy machine), so fewer, bigger chunks win until packing costs more than that.
OWN_CHUNK_BYTES = 16 * 2**20
WITHDRAWN = "withdrawn"
SENDER_CLOSED = "the sender closed"


# ============================================================================ sender


@dataclass
class _Version:
    layout: Layout
    tensors: list[torch.Tensor]

    @property
    def version(self) -> int:
        return self.layout.version


@dataclass
class _Member:
    """One registered receiver (one incarnation: a restart registers a new nonce)."""

    worker_id: str
    nonce: str
    pid: int
    host: str
    want_seq: int = -1  # the newest request it made
    offered_seq: int = -1  # the newest request the sender answered (or found withdrawn)
    delivered: int | None = None  # the newest version it acknowledged
    channel: Any = None  # the group
    backend: str = ""
    forming: bool = False
    failed: str | None = None  # why it was dropped; it must register again

    def label(self) -> str:
        return f"{self.worker_id!r} (pid {self.pid} on {self.host})"


@dataclass
class _Delivery:
    """One ``send`` waiting for its targets."""

    version: int
    deadline: Deadline
    targets: list[_Member] = field(default_factory=list)


class NcclSender(TransportSender):
    def __init__(
        self,
        options: NcclTransportOptions,
        server: Any,
        store_host: str,
        port: int,
        timeout: float,
        release: Any,
        signer: Signer,
    ) -> None:
        self.options = options
        self.default_timeout = timeout
        self.store_host = store_host
        self.port = port
        self._signer = signer
        self._server = server
        self._release = release
        self._address = (
            control.local_address(options.host) if control.is_loopback(options.host) else options.host
        )
        self._backend = groups.resolve_backend(options.backend)
        self._ctl = Control(server, NAMESPACE, signer, store_host, port)  # the caller's thread only
        self._cond = threading.Condition()
        self._members: dict[str, _Member] = {}
        self._current: _Version | None = None
        self._delivery: _Delivery | None = None
        self._staging: dict[Any, list[Any]] = {}
        #: Broadcasts started from each staging buffer ((device, slot)) and not yet known to
        #: be done, across deliveries: a dropped receiver's may still be pending.
        self._in_flight: dict[tuple[Any, int], list[tuple[_Member, Any]]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by send(): serve now, not at the next poll
        self._closed = False
        self.last_version: int | None = None
        #: Seconds and bytes of the last send (publish to the last acknowledgement).
        self.last_send_seconds: float | None = None
        self.last_send_bytes = 0
        self._thread = threading.Thread(target=self._serve, name="forge-nccl-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ send

    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        if self._closed:
            raise TransportError("nccl sender is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(weights.version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"weight versions must strictly increase: got {version} after {self.last_version}"
            )
        start = time.perf_counter()
        tensors = [
            (name, t.detach() if t.is_contiguous() else t.detach().contiguous())
            for name, t in weights.items()
        ]
        bucket = self.options.bucket_mb * 2**20
        # Checksums per chunk (in the signed offer) let a receiver refuse bytes that are not
        # this version's instead of acknowledging them: ~40 ms per 500 MB on each side here.
        layout = Layout.build(version, tensors, bucket, OWN_CHUNK_BYTES).with_sums([t for _, t in tensors])
        with self._cond:
            self._ctl.set(META, layout.to_json(), deadline)
            self._ctl.set(LATEST, str(version), deadline)
            self._current = _Version(layout, [t for _, t in tensors])
            # Receivers that registered before this call are owed this version.
            self._handle_events(self._ctl, deadline)
            delivery = _Delivery(version, deadline, [m for m in self._members.values() if m.failed is None])
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
        self.last_send_seconds = time.perf_counter() - start
        self.last_send_bytes = layout.nbytes
        if self._closed:
            raise TransportError(f"nccl sender closed while sending version {version}")
        if failed or missing:
            got = len(delivery.targets) - len(failed) - len(missing)
            what = "; ".join(f"{m.label()}: {m.failed}" for m in failed + missing)
            msg = (
                f"weights version {version} did not reach {len(failed) + len(missing)} of "
                f"{len(delivery.targets)} receivers: {what}. {got} received it; they are dropped "
                "until they register again (a restarted receiver does so itself)"
            )
            raise (TransportError if failed else TransportTimeout)(msg)
        log.debug(
            "nccl: version %d (%.1f MiB) reached %d receiver(s)",
            version,
            layout.nbytes / 2**20,
            len(delivery.targets),
        )

    # ------------------------------------------------------------- membership

    def _handle_events(self, ctl: Control, deadline: Deadline | None = None) -> bool:
        """Apply queued join/want events (caller holds ``_cond``); whether there were any."""
        events = ctl.pop_all(EVENTS, deadline)
        control.log_refused(ctl, "nccl")
        for ev in events:
            if ev.get("type") == "join":
                for old in self._members.values():
                    if old.worker_id == ev["worker_id"] and old.failed is None:
                        old.failed = "replaced by a new incarnation of the same worker"
                self._members[ev["nonce"]] = _Member(ev["worker_id"], ev["nonce"], int(ev["pid"]), ev["host"])
                log.info(
                    "nccl: receiver %r registered (pid %s on %s)", ev["worker_id"], ev["pid"], ev["host"]
                )
            elif ev.get("type") == "want":
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
            ctl.set_json(member_key(m.nonce, "accept"), {"backend": backend})
            store = signed_store(ctl.raw, NAMESPACE + member_key(m.nonce, "pg/"), self._signer)
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

    def _deadline_for(self, m: _Member, version: int) -> Deadline:
        d = self._delivery
        if d is not None and d.version == version and any(t is m for t in d.targets):
            return d.deadline
        return Deadline(self.default_timeout)

    def _deliver(self, ctl: Control, current: _Version, batch: list[_Member]) -> None:
        layout, version = current.layout, current.version
        with self._cond:
            deadlines = {m.nonce: self._deadline_for(m, version) for m in batch}
        offer = layout.to_json()
        active: list[tuple[_Member, int]] = []
        for m in batch:
            seq = m.want_seq
            try:
                got = ctl.compare_set(member_key(m.nonce, f"offer/{seq}"), "", offer, deadlines[m.nonce])
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
        pending = self._in_flight
        packed_count: dict[Any, int] = {}
        works: list[tuple[_Member, Any]] = []
        for chunk in layout.chunks:
            by_device: dict[Any, list[_Member]] = {}
            for m, _ in active:
                if m.failed is None:
                    by_device.setdefault(groups.device_for(m.backend), []).append(m)
            for device, members in by_device.items():
                src = self._direct(current, chunk, device)
                slot = None
                if src is None:
                    n = packed_count.get(device, 0)
                    packed_count[device] = n + 1
                    slot = (device, n % 2)
                    self._claim(slot, deadlines, progress)
                    src = self._pack(current, chunk, device, n % 2)
                for m in members:
                    if m.failed is not None:
                        continue
                    try:
                        w = groups.broadcast(m.channel, src, 0, deadlines[m.nonce].remaining())
                    except Exception as exc:  # noqa: BLE001
                        self._fail(m, f"broadcast failed: {short(exc)}")
                        continue
                    (works if slot is None else pending.setdefault(slot, [])).append((m, w))
        for ws in pending.values():
            works.extend(ws)
        self._wait_works(works, deadlines, progress)
        for slot in list(pending):  # what is left is a dropped receiver's: checked at the next pack
            pending[slot] = [(m, w) for m, w in pending[slot] if not w.is_completed()]
        _synchronize(self._staging)
        # A finished broadcast on the root only means the bytes left; the receiver's
        # acknowledgement means they all arrived and it holds the version.
        waiting = [(m, seq) for m, seq in active if m.failed is None]
        sent = time.monotonic()
        backoff = Backoff(self.options.poll_interval)
        while waiting and not self._stop.is_set():
            still = []
            for m, seq in waiting:
                try:
                    ack = ctl.get(member_key(m.nonce, "ack"), deadlines[m.nonce])
                    acked = ack is not None and int(ack) >= seq
                    closed = None if acked else ctl.get(member_key(m.nonce, "closed"), deadlines[m.nonce])
                    if closed is not None:
                        # A receiver acknowledges before it closes: one that took this
                        # version and closed between the two reads has its ack there now.
                        ack = ctl.get(member_key(m.nonce, "ack"), deadlines[m.nonce])
                        acked = ack is not None and int(ack) >= seq
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

    def _claim(self, slot: tuple[Any, int], deadlines: dict[str, Deadline], progress: dict[str, float]) -> None:
        """Make staging buffer ``slot`` free to repack: wait for its broadcasts to live
        receivers, and retire it if one to a dropped receiver is still pending.

        Dropping a receiver does not cancel its broadcasts: a gloo send waiting on a
        stopped (SIGSTOP, frozen VM) peer goes on reading the buffer when the peer resumes,
        and a NCCL kernel may still be queued. Repacking the buffer under it would hand
        that receiver later chunks (or versions) as this one's. The work keeps the retired
        buffer alive until it ends or the dropped channel is torn down; a fresh buffer
        takes the slot."""
        works = self._in_flight.pop(slot, [])
        self._wait_works(works, deadlines, progress)
        if any(not w.is_completed() for _, w in works):
            bufs = self._staging.get(slot[0])
            if bufs is not None:
                bufs[slot[1]] = None
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
        backoff = Backoff(self.options.poll_interval)
        while waiting:
            still = []
            for m, w in waiting:
                if m.failed is not None:
                    continue
                if w.is_completed():
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
                time.sleep(backoff.next())

    @staticmethod
    def _direct(current: _Version, chunk: Chunk, device: Any) -> Any:
        """The bytes of ``chunk`` in its tensor's own memory, when it is (part of) one tensor
        already on ``device``; else None."""
        if len(chunk.entries) != 1:
            return None
        e = current.layout.entries[chunk.entries[0]]
        t = current.tensors[chunk.entries[0]]
        if t.device != device:
            return None
        return tensor_bytes(t)[chunk.start - e.offset : chunk.end - e.offset]

    def _pack(self, current: _Version, chunk: Chunk, device: Any, slot: int) -> Any:
        """``chunk`` copied into staging buffer ``slot`` of ``device``."""
        import torch

        layout = current.layout
        bufs = self._staging.setdefault(device, [None, None])
        buf = bufs[slot]
        if buf is None or buf.numel() < chunk.nbytes:
            bufs[slot] = None  # free first: two of these may not fit on a GPU
            size = max(chunk.nbytes, max((c.nbytes for c in layout.chunks if len(c.entries) > 1), default=0))
            buf = bufs[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        for ix in chunk.entries:
            e = layout.entries[ix]
            lo, hi = max(e.offset, chunk.start), min(e.end, chunk.end)
            src = tensor_bytes(current.tensors[ix])[lo - e.offset : hi - e.offset]
            copy_bytes(buf[lo - chunk.start : hi - chunk.start], src)
        return buf[: chunk.nbytes]

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
            try:
                ctl.set(member_key(m.nonce, "closed"), f"dropped by the sender: {m.failed}")
            except STORE_ERRORS:
                pass

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
            try:
                self._ctl.set(member_key(m.nonce, "closed"), SENDER_CLOSED, Deadline(1.0))
            except STORE_ERRORS:
                pass
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
        self._in_flight.clear()
        self._ctl = None  # type: ignore[assignment]
        self._server = None
        if self._release is not None:
            self._release()  # the transport drops its reference: the store's port closes


# ========================================================================== receiver


class _ChannelBroken(Exception):
    pass


class _TornTransfer(Exception):
    """Bytes that landed are not the ones the sender's checksums describe."""


class NcclReceiver(TransportReceiver):
    """Receives versions into one buffer it reuses. The tensors :meth:`receive` yields are
    views of that buffer, valid until the next :meth:`receive` (copy them, as every
    generator does when it loads them)."""

    def __init__(
        self, options: NcclTransportOptions, worker_id: str, host: str, port: int, timeout: float, secret: str
    ) -> None:
        self.options = options
        self._signer = Signer(secret)
        self.worker_id = worker_id
        self.host = host
        self.port = int(port)
        self.default_timeout = timeout
        self._ctl: Control | None = None
        self._nonce: str | None = None
        self._seq = 0
        self._want_sent = False
        self._pg: Any = None
        self._backend = ""
        self._buffer: Any = None
        self._held: Layout | None = None
        self._closed = False
        #: (version, bytes received, bytes total) of the transfer in progress or last done.
        self.progress: tuple[int, int, int] | None = None
        try:  # register now, so that the next send counts on us; else on first receive
            self._register(Deadline(min(5.0, options.connect_timeout)))
        except STORE_ERRORS as exc:
            log.info("nccl receiver %s: sender not reachable yet (%s); will retry", worker_id, short(exc))
            self._disconnect()

    def latest_version(self) -> int | None:
        """The newest version the sender published (for a generator that joins late)."""
        try:
            if self._ctl is None:
                self._ctl = self._connect(self.options.connect_timeout)
            raw = self._ctl.get(LATEST, Deadline(MAX_QUERY))
        except STORE_ERRORS as exc:
            raise TransportError(
                f"nccl: the sender at {self.host}:{self.port} is unreachable: {short(exc)}"
            ) from exc
        return None if raw is None else int(raw)

    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for ``version`` and receive it completely; then yield views of it."""
        if self._closed:
            raise TransportError(f"nccl receiver {self.worker_id} is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(version)
        if self._held is not None and self._held.version == version:
            return self._held.views(self._buffer)
        last_error = "no version offered"
        while True:
            if deadline.expired:
                raise TransportTimeout(
                    f"nccl receiver {self.worker_id}: weights version {version} did not arrive from the "
                    f"sender at {self.host}:{self.port} within {deadline.seconds:g} s ({last_error}); "
                    "is the trainer running?"
                )
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
                self._disconnect()
                deadline.sleep(0.25)
                continue
            if layout is None:
                last_error = "no version offered"
                continue
            if layout.version == version:
                return layout.views(self._buffer)
            if layout.version > version:
                raise TransportError(
                    f"nccl receiver {self.worker_id}: weights version {version} was superseded by "
                    f"{layout.version} (the sender only serves its newest version); receive "
                    f"{layout.version} instead (latest_version() tells it)"
                )
            # An older version (we asked ahead of the trainer): keep waiting for ours.

    # --------------------------------------------------------------- internals

    def _connect(self, timeout: float) -> Control:
        """A connection to a sender that proved the secret (TransportError if not)."""
        ctl = Control.connect(self.host, self.port, NAMESPACE, timeout, self._signer)
        control.check_sender(ctl)
        return ctl

    def _register(self, deadline: Deadline) -> None:
        if self._ctl is None:
            self._ctl = self._connect(min(self.options.connect_timeout, deadline.remaining() or 0.05))
        nonce = control.join(self._ctl, EVENTS, self.worker_id, self.host, deadline)
        self._nonce, self._seq, self._want_sent = nonce, 0, False

    def _take_one(self, deadline: Deadline) -> Layout | None:
        """Ask for the next version and receive what the sender offers; None when nothing
        was offered before the deadline (the request is withdrawn)."""
        ctl, nonce, seq = self._ctl, self._nonce, self._seq
        assert ctl is not None and nonce is not None
        if not self._want_sent:
            ctl.push(EVENTS, {"type": "want", "nonce": nonce, "seq": seq}, deadline)
            self._want_sent = True
        offer_key = member_key(nonce, f"offer/{seq}")
        offer: bytes | str | None = None
        backoff = Backoff(self.options.poll_interval)
        next_closed_check = 0.0
        while not deadline.expired:
            if time.monotonic() >= next_closed_check:  # rarely: it only matters when waiting long
                closed = ctl.get(member_key(nonce, "closed"), deadline)
                if closed is not None:
                    if closed.decode() == SENDER_CLOSED:  # an orderly end: no point waiting
                        raise TransportError(
                            f"nccl receiver {self.worker_id}: the sender at {self.host}:{self.port} closed "
                            "(the trainer finished or is restarting)"
                        )
                    raise _ChannelBroken(closed.decode())
                next_closed_check = time.monotonic() + self.options.poll_interval
            if self._pg is None:
                accept = ctl.get_json(member_key(nonce, "accept"), deadline)
                if accept is not None:
                    self._connect_channel(accept["backend"], deadline)
                    backoff.reset()
                    continue
            else:
                offer = ctl.get(offer_key, deadline)
                if offer is not None:
                    break
            backoff.sleep(deadline)
        if offer is None:
            # Withdraw the request, unless the sender took it in the meantime.
            got = ctl.compare_set(offer_key, "", WITHDRAWN, Deadline(MAX_QUERY))
            if got == WITHDRAWN:
                self._seq, self._want_sent = seq + 1, False
                return None
            offer = got
            if self._pg is None:  # offered before our group formed: cannot take it
                raise _ChannelBroken("offered a version before the channel formed")
        layout = Layout.from_json(offer)
        self._receive_into_buffer(layout, deadline)
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
        prefixed = signed_store(store, NAMESPACE + member_key(self._nonce, "pg/"), self._signer)
        try:
            self._pg = groups.make_group(prefixed, 1, 2, backend, seconds, control.local_address(self.host))
        except Exception as exc:
            raise _ChannelBroken(f"could not form the group with the sender: {short(exc)}") from exc
        self._backend = backend

    def _receive_into_buffer(self, layout: Layout, deadline: Deadline) -> None:
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
        try:
            works = [
                (c, groups.broadcast(self._pg, self._buffer[c.start : c.end], 0, op_timeout))
                for c in layout.chunks
            ]
            op_deadline = Deadline(op_timeout + 1.0)
            for i, (c, w) in enumerate(works):
                groups.wait(w, op_deadline)
                if self._buffer.is_cuda:
                    # NCCL's wait() only orders streams; the checksum must see the bytes.
                    torch.cuda.current_stream(self._buffer.device).synchronize()
                # Checked while the next chunks are on the wire.
                if not layout.chunk_intact(i, self._buffer):
                    raise _TornTransfer(
                        f"chunk {i} ({c.start}-{c.end}) does not match the sender's checksum (bytes of "
                        "another chunk or version landed there)"
                    )
                done += c.nbytes
                self.progress = (layout.version, done, layout.nbytes)
        except Exception as exc:
            raise _ChannelBroken(
                f"transfer of version {layout.version} broke after {done} of {layout.nbytes} bytes: {short(exc)}"
            ) from exc
        self._held = layout

    def _abandon(self, reason: str) -> None:
        """Leave this channel: the next receive registers afresh."""
        holder, self._pg = [self._pg], None
        groups.destroy_soon(holder)  # a broken group's teardown may wait for its dead peer
        if self._ctl is not None and self._nonce is not None:
            try:
                self._ctl.set(
                    member_key(self._nonce, "closed"), f"receiver {self.worker_id}: {reason}", Deadline(1.0)
                )
            except STORE_ERRORS:
                pass
        self._nonce = None

    def _disconnect(self) -> None:
        self._ctl = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pg is not None:
            holder, self._pg = [self._pg], None
            if not groups.destroy_all(holder, graceful=True, timeout=10):
                log.warning("nccl receiver %s: tearing down its group took over 10 s", self.worker_id)
        if self._ctl is not None and self._nonce is not None:
            try:
                self._ctl.set(
                    member_key(self._nonce, "closed"), f"receiver {self.worker_id} closed", Deadline(1.0)
                )
            except STORE_ERRORS:
                pass
        self._ctl = None
        self._buffer = None
        self._held = None


def _synchronize(devices: Mapping[Any, Any]) -> None:
    """Wait for the GPU work queued on these devices (NCCL's wait() does not block the CPU)."""
    for device in devices:
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.current_stream(device).synchronize()


#: Bound of a single bookkeeping query made outside any caller's deadline.
MAX_QUERY = 5.0


# ========================================================================= transport


class NcclTransport(control.StoreHostedTransport, Transport):
    """Factory ``NcclTransport(options, *, context)``. On the trainer, ``sender()`` starts the
    control store; ``receiver_spec()`` tells receivers in other processes where it is.
    In a receiver's process build it with ``context=None`` and pass that spec."""

    name = "nccl"
    namespace = NAMESPACE

    sender_class = NcclSender
    receiver_class = NcclReceiver
