"""The ``delta`` receiver: one connection to the sender, the bytes of the last version it
received whole (its base), and the deltas applied to them in place.

Per ``receive(v)``: ask for ``v`` naming the base held (version and digest); the sender
answers with an offer (a delta against that base, or the version whole), its blocks and
an end. A delta against another base than the one held is refused in one line without
touching anything; otherwise each block lands in the held bytes, every tensor's xxh3-128
is compared with the offer's, and only then is the version acknowledged and yielded.
On any mismatch the receiver says so, forgets its base (its bytes may be half-applied)
and takes the full version the sender sends next: never a partial or wrong version.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import TransportReceiver
from forgerl_plugins.transports.common.control import Deadline, short
from forgerl_plugins.transports.delta import encoding, seed, wire
from forgerl_plugins.transports.delta.encoding import TensorInfo
from forgerl_plugins.transports.delta.options import Options

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

log = logging.getLogger(__name__)

#: The largest block an offer may announce (``block_mb``'s bound).
MAX_BLOCK = 64 * 2**20


@dataclass
class Held:
    version: int
    infos: list[TensorInfo]
    data: list[np.ndarray]
    digest: str


@dataclass
class Received:
    """What the last ``receive`` took (benchmarks read it)."""

    version: int
    base: int | None
    wire_bytes: int
    decode_seconds: float
    refused: list[str]


class SenderClosed(wire.WireError):
    """The sender said goodbye on this connection (it closed; a resumed trainer may listen again)."""


class OfferError(ValueError):
    """An offer whose header does not describe a version (a sender bug, or another protocol)."""


class DeltaReceiver(TransportReceiver):
    name = "delta"

    def __init__(
        self, options: Options, worker_id: str, host: str, port: int, timeout: float, key: bytes
    ) -> None:
        self.options = options
        self.worker_id = worker_id
        self.host = host
        self.port = int(port)
        self.default_timeout = timeout
        self._key = key
        self._conn: wire.Conn | None = None
        self._held: Held | None = None
        # The model folder this receiver's generator loaded (seed_from): its first version
        # may come as a delta against those files.
        self._seed_path: Path | None = None
        self._rid = 0
        self._drain_rid: int | None = None
        self._closed = False
        #: (version, bytes received, bytes total) of the transfer in progress or last done.
        self.progress: tuple[int, int, int] | None = None
        self.last_received: Received | None = None
        # Register at once, so that the next send counts on this receiver; a sender that is
        # not up yet is tried again by the first receive. A refusal (another run's secret)
        # is final.
        try:
            self._connect(Deadline(min(5.0, options.connect_timeout)))
        except wire.Refused:
            self.close()
            raise
        except OSError as exc:
            log.info("delta receiver %s: sender not reachable yet (%s); will retry", worker_id, short(exc))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _open(self, deadline: Deadline, query: bool = False) -> tuple[wire.Conn, int | None]:
        sock = socket.create_connection((self.host, self.port), timeout=max(0.01, deadline.remaining()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = wire.Conn(sock, server=False)
        try:
            latest = wire.client_handshake(conn, self._key, self.worker_id, deadline, query=query)
        except BaseException:
            conn.close()
            raise
        return conn, latest

    def _connect(self, deadline: Deadline) -> None:
        self._conn, _ = self._open(deadline)
        self._drain_rid = None

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._drain_rid = None

    def latest_version(self) -> int | None:
        """The sender's newest version, asked on a short connection of its own (the main one
        may be mid-request)."""
        if self._closed:
            raise TransportError(f"delta receiver {self.worker_id} is closed")
        try:
            conn, latest = self._open(Deadline(min(5.0, self.options.connect_timeout)), query=True)
        except OSError as exc:
            raise TransportError(f"delta: the sender at {self.address} is unreachable: {short(exc)}") from exc
        conn.close()
        return latest

    def seed_from(self, model_path: Path | str) -> None:
        """The generator loaded ``model_path`` at start: a receiver holding nothing asks for
        its first version against those files (``transport.options.seed``)."""
        if self.options.seed:
            self._seed_path = Path(model_path)

    # --------------------------------------------------------------- receive

    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive ``version`` whole and checked, then yield views of the held bytes (valid
        until the next ``receive``; they are the next delta's base: do not modify them)."""
        if self._closed:
            raise TransportError(f"delta receiver {self.worker_id} is closed")
        deadline = Deadline(self.default_timeout if timeout is None else timeout)
        version = int(version)
        if self._held is None or self._held.version != version:
            self._fetch(version, deadline)
        return iter(self._views())

    def _fetch(self, version: int, deadline: Deadline) -> None:
        last_error = "no answer"
        pause = 0.01
        closed = False
        while True:
            if deadline.expired:
                raise self._timed_out(version, deadline, last_error)
            started = False
            try:
                if self._conn is None:
                    self._connect(deadline)
                assert self._conn is not None
                if self._drain_rid is not None:
                    self._drain(self._conn, deadline)
                self._rid += 1
                rid, held = self._rid, self._held
                want = {"rid": rid, "version": version, "base": held.version if held else None,
                        "digest": held.digest if held else None,
                        "seed": held is None and self._seed_path is not None}  # fmt: skip
                self._conn.send_json(wire.WANT, want, deadline)
                while True:
                    kind, msg = self._conn.recv_json(deadline, wire.CONTROL_LIMIT)
                    if kind == wire.OFFER and msg.get("rid") == rid:
                        started = True
                        if self._take(self._conn, msg, version, deadline):
                            return
                    elif kind == wire.GONE and msg.get("rid") == rid:
                        raise self._superseded(version, int(msg["latest"]))
                    elif kind == wire.BYE:
                        raise SenderClosed("the sender closed this connection")
                    elif kind != wire.CANCELLED:
                        raise wire.WireError(f"unexpected {wire.NAMES.get(kind, kind)} frame")
            except TimeoutError:
                if started or self._conn is None:
                    self._drop()  # mid-stream: the rest would arrive unasked
                else:  # asked, nothing came: withdraw the request, keep the registration
                    self._cancel(rid)
                raise self._timed_out(version, deadline, "no answer in time") from None
            except wire.Refused:
                self._drop()
                raise
            except (OSError, OfferError) as exc:
                if isinstance(exc, ConnectionRefusedError) and closed:
                    # It said goodbye and nobody listens there now: no point waiting. (A
                    # trainer that resumes on the same port is reconnected to above.)
                    raise TransportError(
                        f"delta receiver {self.worker_id}: the sender at {self.address} closed "
                        "(the trainer finished or is restarting)"
                    ) from None
                closed = closed or isinstance(exc, SenderClosed)
                # A refused reconnection says less than what broke the connection first.
                if not (isinstance(exc, ConnectionRefusedError) and last_error != "no answer"):
                    last_error = short(exc)
                log.info("delta receiver %s: %s; reconnecting", self.worker_id, last_error)
                self._drop()
                time.sleep(min(pause, deadline.remaining()))
                pause = min(pause * 2, 0.5)

    def _cancel(self, rid: int) -> None:
        try:
            assert self._conn is not None
            self._conn.send_json(wire.CANCEL, {"rid": rid}, Deadline(1.0))
            self._drain_rid = rid
        except (OSError, TimeoutError):
            self._drop()

    def _drain(self, conn: wire.Conn, deadline: Deadline) -> None:
        """Skip what the sender sent for a request this receiver withdrew."""
        while True:
            kind, msg = conn.recv_json(deadline, max(wire.CONTROL_LIMIT, wire.block_limit(MAX_BLOCK)))
            if kind == wire.CANCELLED and isinstance(msg, dict) and msg.get("rid") == self._drain_rid:
                self._drain_rid = None
                return
            if kind == wire.BYE:
                raise SenderClosed("the sender closed this connection")

    def _take(self, conn: wire.Conn, offer: dict[str, Any], version: int, deadline: Deadline) -> bool:
        """Apply one offer; acknowledge it. True when the version is now held, checked."""
        start = time.monotonic()
        infos, blocks, block = _parse_offer(offer, version)
        base = offer.get("base")
        kept = held = self._held
        refusal = ""
        if base == seed.SEED and held is None:
            held, refusal = self._seeded(infos, offer.get("base_digest"), version)
        if not refusal and base is not None and (
            held is None or held.version != base or held.digest != offer.get("base_digest")
            or [(i.name, i.nbytes) for i in held.infos] != [(i.name, i.nbytes) for i in infos]
        ):  # fmt: skip
            refusal = (
                f"delta receiver {self.worker_id}: the delta for version {version} is against base {base}, "
                f"but this receiver holds {'no version' if held is None else f'version {held.version}'}; "
                "asking for the full version"
            )
            log.warning(refusal)
        total = sum(i.nbytes for i in infos)
        limit = wire.block_limit(block)
        targets = self._targets(held, infos, base is not None) if not refusal else []
        self._held = None if not refusal else kept  # the held bytes are being rewritten
        self.progress = (version, 0, total)
        dec = encoding.decompressor()
        wire_bytes, done, broken = 0, 0, ""
        for i, tensor_blocks in enumerate(blocks):
            off = 0
            for kind, raw_len, wire_len in tensor_blocks:
                k, payload = conn.recv(deadline, limit)
                if k != wire.BLOCK or len(payload) != wire_len:
                    raise OfferError(f"expected a block of {wire_len} bytes, got {wire.NAMES.get(k, k)}")
                wire_bytes += wire_len
                if targets and not broken:
                    try:
                        width = encoding.SPARSE_WIDTHS.get(infos[i].dtype)
                        encoding.apply_block(targets[i], off, kind, raw_len, payload, dec, width)
                    except encoding.BlockError as exc:
                        broken = f"{infos[i].name!r}: {exc}"
                off += raw_len
                done += raw_len
                self.progress = (version, done, total)
        k, end = conn.recv_json(deadline)
        if k != wire.END or end.get("rid") != offer.get("rid"):
            raise OfferError(f"expected the offer's END, got {wire.NAMES.get(k, k)}")
        if not refusal:
            bad = [i.name for i, data in zip(infos, targets) if encoding.checksum(data) != i.checksum]
            if broken or bad:
                what = broken or f"checksum mismatch for {bad[:3]}{' and more' if len(bad) > 3 else ''}"
                refusal = (
                    f"delta receiver {self.worker_id}: version {version} "
                    f"({'delta against ' + str(base) if base is not None else 'full'}) refused: {what}"
                )
                log.warning(refusal)
            else:
                self._held = Held(version, infos, targets, encoding.digest(infos))
                if base == seed.SEED:
                    log.info("delta receiver %s: version %d came as %d bytes against the model's files",
                             self.worker_id, version, wire_bytes)  # fmt: skip
        self.last_received = Received(
            version, base, wire_bytes, time.monotonic() - start, [refusal] if refusal else []
        )
        conn.send_json(wire.ACK, {"rid": offer.get("rid"), "version": version, "ok": not refusal,
                                  "why": refusal}, deadline)  # fmt: skip
        return not refusal

    def _seeded(self, infos: list[TensorInfo], base_digest: Any, version: int) -> tuple[Held | None, str]:
        """The base the model's files give for ``infos``, when its digest is the sender's;
        else a refusal (the version then comes whole)."""
        why = "this receiver was given no model folder"
        if self._seed_path is not None:
            built, why = seed.seed_version(self._seed_path, infos)
            if built is not None and built.digest == base_digest:
                return Held(seed.SEED, built.infos, built.data, built.digest), ""
            if built is not None:
                why = f"the files in {self._seed_path} are not the trainer's starting weights (digest differs)"
        refusal = (
            f"delta receiver {self.worker_id}: version {version} is a delta against the model's files, "
            f"but {why}; asking for the full version"
        )
        log.warning(refusal)
        return None, refusal

    def _targets(self, held: Held | None, infos: list[TensorInfo], delta: bool) -> list[np.ndarray]:
        """Where the blocks land: the held bytes (a delta xors into them; a full version
        reuses them when the sizes match: fresh memory costs page faults), else new arrays."""
        import numpy as np

        if held is not None and [i.nbytes for i in held.infos] == [i.nbytes for i in infos]:
            return held.data
        assert not delta, "a delta is only applied to the base it names"
        return [np.empty(i.nbytes, dtype=np.uint8) for i in infos]

    def _views(self) -> list[tuple[str, torch.Tensor]]:
        import torch

        assert self._held is not None
        out = []
        for info, data in zip(self._held.infos, self._held.data):
            dtype = getattr(torch, info.dtype)
            if not info.nbytes:  # numpy gives an empty array stride 0, which torch cannot view
                out.append((info.name, torch.empty(info.shape, dtype=dtype)))
                continue
            out.append((info.name, torch.from_numpy(data).view(dtype).reshape(info.shape)))
        return out

    # -------------------------------------------------------------- failures

    def _superseded(self, version: int, newest: int) -> TransportError:
        return TransportError(
            f"delta receiver {self.worker_id}: weights version {version} was superseded by {newest}; "
            f"receive {newest} instead (latest_version() tells it)"
        )

    def _timed_out(self, version: int, deadline: Deadline, last_error: str) -> TransportTimeout:
        return TransportTimeout(
            f"delta receiver {self.worker_id}: weights version {version} did not arrive from the sender at "
            f"{self.address} within {deadline.seconds:g} s ({last_error}); is the trainer running?"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._conn is not None:
            try:
                self._conn.send(wire.BYE, b"", Deadline(0.5))
            except (OSError, TimeoutError):
                pass
        self._drop()
        self._held = None


def _parse_offer(offer: dict[str, Any], version: int) -> tuple[list[TensorInfo], list[list[tuple]], int]:
    """The offer's tensors and blocks, each size checked against the others (a header that
    promises more than its tensors hold is refused before any block is read)."""
    import torch

    try:
        if int(offer["version"]) != version:
            raise OfferError(f"an offer of version {offer['version']} for a request of {version}")
        block = int(offer["block"])
        if not 0 < block <= MAX_BLOCK:
            raise OfferError(f"blocks of {block} bytes (at most {MAX_BLOCK})")
        infos, blocks = [], []
        for t in offer["tensors"]:
            dtype = getattr(torch, str(t["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise OfferError(f"unknown dtype {t['dtype']!r}")
            shape = tuple(int(d) for d in t["shape"])
            numel = 1
            for d in shape:
                if d < 0:
                    raise OfferError(f"negative dimension in {shape}")
                numel *= d
            nbytes = int(t["nbytes"])
            if nbytes != numel * dtype.itemsize:
                raise OfferError(f"{t['name']!r}: {nbytes} bytes for shape {shape} of {dtype}")
            tb = [(int(k), int(r), int(w)) for k, r, w in t["blocks"]]
            if sum(r for _, r, _ in tb) != nbytes or any(
                k not in encoding.KINDS or not 0 < r <= block or not 0 <= w <= wire.block_limit(block)
                for k, r, w in tb
            ):
                raise OfferError(f"{t['name']!r}: its blocks do not cover its {nbytes} bytes")
            infos.append(TensorInfo(str(t["name"]), str(t["dtype"]), shape, nbytes, str(t["checksum"])))
            blocks.append(tb)
        return infos, blocks, block
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, OfferError):
            raise
        raise OfferError(f"a malformed offer: {short(exc)}") from exc
