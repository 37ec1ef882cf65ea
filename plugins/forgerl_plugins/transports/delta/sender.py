"""The ``delta`` sender: trainer rank 0 listens on one TCP port; each receiver holds one
connection, asks for a version naming the base it holds, and gets that version as a delta
against the base or whole.

Threads: one accepts connections; one per connection serves that receiver (waits for its
request, encodes, streams, waits for its acknowledgement), so a slow receiver delays only
itself. ``send`` publishes a version and waits until every receiver connected at that
moment has acknowledged it, failed, or the timeout passed, and names the others.

What the sender keeps (memory stays bounded): the current version's bytes, and the bytes
of each older version some connected receiver has *confirmed* (acknowledged after its
checksums matched) — its base. A base no live receiver holds is dropped; a receiver asking
against it gets a full version. Deltas are encoded once per (version, base) and shared by
every receiver on that base. A receiver that holds nothing but reads the run's model
folder gets its first version against the files (seed.py), when the sender was given one.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import TransportSender
from forgerl.types import WeightSet
from forgerl_plugins.transports.common.control import Deadline, short
from forgerl_plugins.transports.delta import encoding, seed, wire
from forgerl_plugins.transports.delta.encoding import Block, Version
from forgerl_plugins.transports.delta.options import Options

log = logging.getLogger(__name__)

_ids = itertools.count(1)


@dataclass
class Member:
    """One connected receiver, as the sender sees it."""

    worker_id: str
    conn: wire.Conn
    key: int = field(default_factory=lambda: next(_ids))
    #: The version this receiver acknowledged last: the bytes it holds, its base.
    confirmed: int | None = None
    #: Why it is gone (a broken connection, a stall, a goodbye); None while it is live.
    gone: str | None = None
    wake_r: int = -1
    wake_w: int = -1

    def __post_init__(self) -> None:
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:  # full (it will wake anyway) or closed (it is gone)
            pass

    def close_pipe(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass
class Served:
    """What one receiver got of one version (benchmarks and the sync/bytes metric read it)."""

    worker_id: str
    version: int
    base: int | None
    wire_bytes: int
    full: bool
    why_full: str = ""


class DeltaSender(TransportSender):
    name = "delta"

    def __init__(
        self,
        options: Options,
        listener: socket.socket,
        timeout: float,
        key: bytes,
        release: Any,
        seed_path: Path | None = None,
    ) -> None:
        self.options = options
        # Version 0 from the model's files (seed.py), built at the first send from its tensors.
        self._files = seed.FilesBase(seed_path)
        self.default_timeout = timeout
        self.block = options.block_mb * 2**20
        self._key = key
        self._release = release
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._cond = threading.Condition()
        self._closed = False
        self._current: Version | None = None
        self._versions: dict[int, Version] = {}
        self._deltas: dict[tuple[int, int], list[list[Block]] | None] = {}
        self._encode_locks: dict[tuple[int, int], threading.Lock] = {}
        self._members: dict[int, Member] = {}
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.last_version: int | None = None
        self.last_send_bytes = 0
        self.last_send_seconds: float | None = None
        #: Seconds spent snapshotting (copy + checksums) and encoding deltas, per version.
        self.encode_seconds: dict[int, float] = {}
        #: What each receiver got, per version (the newest few versions).
        self.served: dict[int, list[Served]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._acceptor = threading.Thread(target=self._accept_loop, name="forge-delta-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ send

    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        if self._closed:
            raise TransportError("delta sender is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(weights.version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"weight versions must strictly increase: got {version} after {self.last_version}"
            )
        start = time.monotonic()
        snap = encoding.snapshot(version, iter(weights.items()))
        self._files.first(snap.infos)
        self.encode_seconds[version] = time.monotonic() - start
        with self._cond:
            self._current = snap
            self._versions[version] = snap
            self.last_version = version
            self.served[version] = []
            for old in [v for v in self.served if v < version - 8]:  # a long run keeps the last few
                del self.served[old]
            for old in [v for v in self.encode_seconds if v < version - 8]:
                del self.encode_seconds[old]
            self._prune()
            expected = [m for m in self._members.values() if m.gone is None]
            for m in expected:
                m.wake()
            while True:
                waiting = [m for m in expected if m.confirmed != version and m.gone is None]
                if not waiting or deadline.expired:
                    break
                self._cond.wait(min(deadline.remaining(), 1.0))
            failed = [m for m in expected if m.confirmed != version and m.gone is not None]
            served = list(self.served[version])
        self.last_send_bytes = sum(s.wire_bytes for s in served)
        self.last_send_seconds = time.monotonic() - start
        if failed:
            reasons = "; ".join(f"{m.worker_id!r}: {m.gone}" for m in failed)
            late = f"; still waiting for {_names(waiting)}" if waiting else ""
            raise TransportError(f"delta sender: weights version {version} did not reach {reasons}{late}")
        if waiting:
            raise TransportTimeout(
                f"delta sender: {_names(waiting)} did not take weights version {version} within "
                f"{deadline.seconds:g} s (the others have it)"
            )

    def _prune(self) -> None:
        """Keep only the versions some live receiver holds, and the current one (under the lock)."""
        keep = {m.confirmed for m in self._members.values() if m.gone is None and m.confirmed is not None}
        if self._current is not None:
            keep.add(self._current.version)
        live = [m for m in self._members.values() if m.gone is None]
        if live and all(m.confirmed is not None for m in live):
            self._files.free()  # every receiver has a base of its own
        if self._files.version is not None:
            keep.add(seed.SEED)
        for v in [v for v in self._versions if v not in keep]:
            del self._versions[v]
        current = self._current.version if self._current is not None else None
        for k in [k for k in self._deltas if k[0] != current or k[1] not in keep]:
            del self._deltas[k]
            self._encode_locks.pop(k, None)

    @property
    def seed_why(self) -> str:
        """Why a new receiver cannot start from the model's files ("" when it can)."""
        return self._files.why

    # --------------------------------------------------------------- serving

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._listener.fileno(), self._wake_r], [], [], 1.0)
            except (OSError, ValueError):
                return
            if self._closed:
                return
            if self._listener.fileno() not in ready:
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._peer, args=(sock,), name="forge-delta-peer", daemon=True)
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                self._socks.add(sock)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _latest(self) -> int | None:
        return self.last_version

    def _peer(self, sock: socket.socket) -> None:
        conn = wire.Conn(sock, server=True)
        member: Member | None = None

        def admit(worker: str, query: bool) -> None:
            nonlocal member
            if query:
                return
            with self._cond:
                if self._closed:
                    raise TransportError("the sender is closing")
                member = Member(worker, conn)
                self._members[member.key] = member

        try:
            worker, _ = wire.server_handshake(
                conn, self._key, self._latest, Deadline(self.options.connect_timeout), admit
            )
            if member is None:
                return
            log.info("delta sender: receiver %r connected from %s", worker, conn.peer)
            self._serve(member)
        except wire.Refused as exc:
            log.warning("delta sender: refused a connection: %s", exc)
        except Exception as exc:  # whatever breaks serving one receiver fails it, never the trainer
            if member is not None and not self._closed:
                self._set_gone(member, _why(exc))
            if not isinstance(exc, (OSError, TransportError, ValueError)):
                log.exception("delta sender: serving %r failed", member.worker_id if member else conn.peer)
        finally:
            with self._cond:
                self._socks.discard(sock)
                if member is not None:
                    if member.gone is None:
                        member.gone = "disconnected"
                    self._members.pop(member.key, None)
                    self._prune()
                    self._cond.notify_all()
            if member is not None:
                member.close_pipe()
            conn.close()

    def _set_gone(self, member: Member, why: str, level: int = logging.WARNING) -> None:
        with self._cond:
            if member.gone is None:
                member.gone = why
                log.log(level, "delta sender: receiver %r gone: %s", member.worker_id, why)
            self._cond.notify_all()

    def _serve(self, m: Member) -> None:
        """This receiver's requests, one at a time, until it leaves or the sender closes."""
        pending: dict[str, Any] | None = None
        while True:
            with self._cond:
                if self._closed:
                    return
                current = self._current
            if pending is not None and current is not None and current.version >= pending["version"]:
                if current.version > pending["version"]:
                    m.conn.send_json(
                        wire.GONE, {"rid": pending["rid"], "latest": current.version}, self._stall()
                    )
                else:
                    self._offer(m, pending, current)
                pending = None
                continue
            ready, _, _ = select.select([m.conn.sock.fileno(), m.wake_r], [], [], 1.0)
            if m.wake_r in ready:
                os.read(m.wake_r, 4096)
            if m.conn.sock.fileno() not in ready:
                continue
            kind, msg = m.conn.recv_json(self._stall())
            if kind == wire.WANT:
                pending = _want(msg)
            elif kind == wire.CANCEL:
                pending = None
                m.conn.send_json(wire.CANCELLED, {"rid": msg.get("rid")}, self._stall())
            elif kind == wire.BYE:
                self._set_gone(m, "closed by the receiver", logging.INFO)
                return
            else:
                raise wire.WireError(f"unexpected {wire.NAMES.get(kind, kind)} frame from the receiver")

    def _stall(self) -> Deadline:
        return Deadline(self.options.stall_timeout)

    def _offer(self, m: Member, want: dict[str, Any], current: Version) -> None:
        """Stream ``current`` to ``m`` (a delta when it holds a base we hold, else whole),
        then wait for its acknowledgement; a refused delta is followed by the full version."""
        rid = want["rid"]
        base_version, base_digest, blocks, why_full = self._encoded(
            current, want.get("base"), want.get("digest"), bool(want.get("seed"))
        )
        for attempt in range(2):
            sent = self._stream(m, rid, current, base_version, base_digest, blocks)
            served = Served(m.worker_id, current.version, base_version, sent, base_version is None, why_full)
            with self._cond:
                self.served.setdefault(current.version, []).append(served)
            ack = self._await_ack(m, rid)
            if ack is None:  # cancelled
                return
            if ack.get("ok"):
                with self._cond:
                    m.confirmed = current.version
                    self._prune()
                    self._cond.notify_all()
                return
            why = str(ack.get("why", ""))[:300]
            if base_version is None or attempt:
                raise TransportError(f"refused a full version: {why}")
            log.warning("delta sender: %r refused the delta against %s (%s); sending it whole", m.worker_id,
                        base_version, why)  # fmt: skip
            base_version, base_digest, blocks = None, None, self._full(current)
            why_full = f"delta refused: {why}"

    def _await_ack(self, m: Member, rid: int) -> dict[str, Any] | None:
        while True:
            kind, msg = m.conn.recv_json(self._stall())
            if kind == wire.ACK and msg.get("rid") == rid:
                return dict(msg)
            if kind == wire.CANCEL:
                m.conn.send_json(wire.CANCELLED, {"rid": msg.get("rid")}, self._stall())
                return None
            if kind == wire.BYE:
                raise TransportError("closed before acknowledging")
            raise wire.WireError(f"unexpected {wire.NAMES.get(kind, kind)} frame while waiting for an ACK")

    def _stream(
        self,
        m: Member,
        rid: int,
        current: Version,
        base: int | None,
        base_digest: str | None,
        blocks: list[list[Block]],
    ) -> int:
        header = {
            "rid": rid, "version": current.version, "base": base, "base_digest": base_digest, "block": self.block,
            "tensors": [
                {**info.as_json(), "blocks": [[b.kind, b.raw_len, b.wire_len] for b in tb]}
                for info, tb in zip(current.infos, blocks)
            ],
        }  # fmt: skip
        sent = m.conn.send_json(wire.OFFER, header, self._stall())
        for tensor_blocks in blocks:
            for b in tensor_blocks:
                sent += m.conn.send(wire.BLOCK, b.payload, self._stall())
        sent += m.conn.send_json(wire.END, {"rid": rid}, self._stall())
        return sent

    def _full(self, current: Version) -> list[list[Block]]:
        return [encoding.full_blocks(data, self.block) for data in current.data]

    def _encoded(
        self, current: Version, base: Any, digest: Any, seeded: bool = False
    ) -> tuple[int | None, str | None, list[list[Block]], str]:
        """(base used or None, its digest, blocks per tensor, why whole): a delta against ``base`` when
        this sender holds exactly the bytes the receiver claims (same digest); against the
        model's files when the receiver holds nothing but can read them (``seeded``: it
        checks the digest itself); else whole."""
        files = self._files.get(current.infos) if base is None and seeded else None
        if base is None and files is None:
            why = "the receiver holds no version" + (f" (no seed: {self._files.why})" if seeded else "")
            return None, None, self._full(current), why
        with self._cond:
            held = files if base is None else self._versions.get(int(base))
            key = (current.version, seed.SEED if base is None else int(base))
            lock = self._encode_locks.setdefault(key, threading.Lock()) if held is not None else None
        if held is None or lock is None:
            return None, None, self._full(current), f"base {base} is not held by the sender"
        if base is not None and held.digest != digest:
            return (
                None,
                None,
                self._full(current),
                f"the receiver's base {base} is not the sender's (digest differs)",
            )
        if (held is not files and held.version >= current.version) or [
            (i.name, i.dtype, i.nbytes) for i in held.infos
        ] != [(i.name, i.dtype, i.nbytes) for i in current.infos]:
            return None, None, self._full(current), f"base {held.version} has another layout"
        with lock:  # one encoding per (version, base), shared by the receivers on that base
            with self._cond:
                found = key in self._deltas
                cached = self._deltas.get(key)
            if not found:
                start = time.monotonic()
                comp = encoding.compressor(self.options.level)
                blocks = [
                    encoding.delta_blocks(n, b, self.block, comp, encoding.SPARSE_WIDTHS.get(info.dtype))
                    for info, n, b in zip(current.infos, current.data, held.data)
                ]
                size = sum(b.wire_len for tb in blocks for b in tb)
                cached = blocks if size < current.nbytes else None
                with self._cond:
                    self.encode_seconds[current.version] = self.encode_seconds.get(current.version, 0.0) + (
                        time.monotonic() - start
                    )
                    if self._current is current:
                        self._deltas[key] = cached
        if cached is None:
            return None, None, self._full(current), "the delta is not smaller than the full version"
        return held.version, held.digest, cached, ""

    # ----------------------------------------------------------------- close

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            members = list(self._members.values())
            socks = list(self._socks)
            threads = list(self._threads)
            self._cond.notify_all()
        for m in members:
            try:
                m.conn.send(wire.BYE, b"", Deadline(0.5))
            except (OSError, TimeoutError):
                pass
            m.wake()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._acceptor.join(timeout=5)
        self._listener.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        with self._cond:
            self._versions.clear()
            self._deltas.clear()
            self._current = None
        self._release()


def _names(members: list[Member]) -> str:
    return ", ".join(repr(m.worker_id) for m in members)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "stalled (read nothing, or acknowledged nothing, within the stall timeout)"
    return f"connection lost ({short(exc)})" if isinstance(exc, OSError) else short(exc)


def _want(msg: Any) -> dict[str, Any]:
    try:
        want = {"rid": int(msg["rid"]), "version": int(msg["version"]), "base": msg.get("base"),
                "digest": msg.get("digest"), "seed": msg.get("seed") is True}  # fmt: skip
        if want["base"] is not None:
            want["base"] = int(want["base"])
        return want
    except (KeyError, TypeError, ValueError) as exc:
        raise wire.WireError(f"a malformed WANT: {msg!r:.200}") from exc
