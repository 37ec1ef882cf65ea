"""The ``delta`` transport's wire: frames on one TCP connection per receiver, authenticated
with the run's secret.

A frame is ``type (1 byte) | length (8 bytes) | payload | tag``. Its length is checked
against a limit *before* anything is allocated, so a truncated or oversized frame costs at
most the limit, and a connection that stops mid-frame fails at the caller's deadline.

The handshake proves the run's secret both ways without sending it (HMAC-SHA256
challenge-response over two fresh nonces) and derives a session key from the nonces. From
then on every frame carries an HMAC-SHA256 tag over a direction byte, a per-direction
sequence number and the frame itself: a frame a stranger injects, alters, replays or
reflects fails its tag, and the connection is dropped (the receiver reconnects and gets a
full version). Nothing is encrypted: weights cross the wire in the clear (docs/security.md).

Why not TLS: Python's ``ssl`` has no pre-shared-key mode before 3.13, and certificates would
be a second secret to distribute; the run already has one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
from typing import Any

from forgerl.errors import TransportError
from forgerl_plugins.transports.common.control import Deadline

MAGIC = b"FORGERL-DELTA/1\n"
HEADER = struct.Struct("!BQ")
TAG_LEN = 32
NONCE_LEN = 16
#: Frames before the handshake is done are small: a stranger cannot make us allocate more.
HANDSHAKE_LIMIT = 4096
#: The largest control frame (an offer lists every tensor and its blocks).
CONTROL_LIMIT = 64 * 2**20

# Frame types. Receiver → sender: JOIN, WANT, CANCEL, ACK, BYE. Sender → receiver: HELLO,
# WELCOME, REFUSE, OFFER, BLOCK, END, GONE, CANCELLED, BYE.
HELLO, JOIN, WELCOME, REFUSE, WANT, CANCEL, OFFER, BLOCK, END, ACK, GONE, CANCELLED, BYE = range(1, 14)
NAMES = {v: k for k, v in dict(HELLO=HELLO, JOIN=JOIN, WELCOME=WELCOME, REFUSE=REFUSE, WANT=WANT, CANCEL=CANCEL,
         OFFER=OFFER, BLOCK=BLOCK, END=END, ACK=ACK, GONE=GONE, CANCELLED=CANCELLED, BYE=BYE).items()}  # fmt: skip


class WireError(ConnectionError):
    """The connection cannot be trusted any more (closed, truncated, oversized, forged)."""


class Refused(TransportError):
    """The other side does not hold the run's secret (or speaks another protocol)."""


def run_key(secret: str) -> bytes:
    """A key for this purpose only, derived from the run's secret."""
    if not secret:
        raise TransportError("the delta transport needs the run's secret to authenticate its peers")
    return hmac.new(secret.encode(), b"forgerl delta transport", hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def block_limit(block: int) -> int:
    """The largest block frame: a block never travels compressed when that is larger than
    raw, so ``block`` bytes plus room for its tag."""
    return block + 4096


class Conn:
    """One peer's connection: frames out (thread-safe) and in (one reader at a time)."""

    def __init__(self, sock: socket.socket, *, server: bool) -> None:
        self.sock = sock
        self.peer = _peer_name(sock)
        self._server = server
        self._key: bytes | None = None
        self._out_seq = 0
        self._in_seq = 0
        self._wlock = threading.Lock()

    def authenticate(self, session_key: bytes) -> None:
        self._key = session_key

    def _tag(self, outgoing: bool, seq: int, header: bytes, payload: Any) -> bytes:
        assert self._key is not None
        sender_side = self._server == outgoing  # b"s": written by the sender's side
        h = hmac.new(
            self._key, (b"s" if sender_side else b"r") + seq.to_bytes(8, "big") + header, hashlib.sha256
        )
        h.update(payload)
        return h.digest()

    def send(self, kind: int, payload: Any = b"", deadline: Deadline | None = None) -> int:
        """Write one frame; returns its bytes on the wire. Raises ``TimeoutError`` at the
        deadline (a peer that stopped reading), ``OSError`` when the connection broke."""
        header = HEADER.pack(kind, len(payload))
        with self._wlock:
            tag = b""
            if self._key is not None:
                tag = self._tag(True, self._out_seq, header, payload)
                self._out_seq += 1
            self.sock.settimeout(_remaining(deadline))
            if len(payload) < 65536:
                self.sock.sendall(header + bytes(payload) + tag)
            else:  # a block: from the tensor's own memory, no copy
                self.sock.sendall(header)
                self.sock.sendall(payload)
                self.sock.sendall(tag)
        return len(header) + len(payload) + len(tag)

    def send_json(self, kind: int, obj: Any, deadline: Deadline | None = None) -> int:
        return self.send(kind, json.dumps(obj, separators=(",", ":")).encode(), deadline)

    def recv(self, deadline: Deadline | None, limit: int) -> tuple[int, bytearray]:
        """One whole frame, its tag checked. ``WireError`` for a closed connection, a frame
        over ``limit`` bytes (refused before its payload is read) or a forged one;
        ``TimeoutError`` at the deadline."""
        header = self._exact(HEADER.size, deadline)
        kind, length = HEADER.unpack(header)
        if length > limit:
            raise WireError(f"a frame of {length} bytes from {self.peer} (at most {limit}): refused")
        payload = self._exact(length, deadline)
        if self._key is not None:
            tag = self._exact(TAG_LEN, deadline)
            if not hmac.compare_digest(bytes(tag), self._tag(False, self._in_seq, bytes(header), payload)):
                raise WireError(
                    f"a frame from {self.peer} fails its authentication tag (altered or injected)"
                )
            self._in_seq += 1
        return kind, payload

    def recv_json(self, deadline: Deadline | None, limit: int = CONTROL_LIMIT) -> tuple[int, Any]:
        kind, payload = self.recv(deadline, limit)
        if kind in (BLOCK,):
            return kind, payload
        try:
            return kind, json.loads(bytes(payload)) if payload else {}
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError(f"a {NAMES.get(kind, kind)} frame from {self.peer} is not JSON") from exc

    def _exact(self, n: int, deadline: Deadline | None) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self.sock.settimeout(_remaining(deadline))
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise WireError(f"{self.peer} closed the connection" + (" mid-frame" if got else ""))
            got += k
        return buf

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _remaining(deadline: Deadline | None) -> float | None:
    if deadline is None:
        return None
    left = deadline.remaining()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed peer"


# ------------------------------------------------------------------------ handshake


def server_handshake(
    conn: Conn, key: bytes, latest: Any, deadline: Deadline, admit: Any = None
) -> tuple[str, bool]:
    """The sender's side: returns the receiver's worker id and whether it only asks for the
    latest version (a query, not a registration). ``Refused`` for a peer without the secret
    (told so in one line first). ``admit(worker, query)`` runs once the peer is proven and
    before it is welcomed: a receiver whose constructor returned is already counted on."""
    server_nonce = os.urandom(NONCE_LEN)
    conn.send(HELLO, MAGIC + server_nonce, deadline)
    kind, join = conn.recv_json(deadline, HANDSHAKE_LIMIT)
    try:
        worker, client_nonce = str(join["worker"]), bytes.fromhex(join["nonce"])
        tag = bytes.fromhex(join["tag"])
    except (KeyError, TypeError, ValueError):
        kind = -1
    if kind != JOIN or len(client_nonce) != NONCE_LEN:
        conn.send(REFUSE, b"expected a forgerl delta receiver's JOIN", deadline)
        raise Refused(f"{conn.peer} does not speak the delta transport's protocol")
    if not hmac.compare_digest(tag, _mac(key, b"join", server_nonce, client_nonce, worker.encode())):
        conn.send(REFUSE, b"not authenticated with this run's transport secret", deadline)
        raise Refused(f"{conn.peer} (worker {worker!r}) does not hold this run's transport secret")
    if admit is not None:
        admit(worker, bool(join.get("query")))
    proof = _mac(key, b"welcome", client_nonce, server_nonce)
    conn.send_json(WELCOME, {"tag": proof.hex(), "latest": latest()}, deadline)
    conn.authenticate(_mac(key, b"session", server_nonce, client_nonce))
    return worker, bool(join.get("query"))


def client_handshake(
    conn: Conn, key: bytes, worker: str, deadline: Deadline, query: bool = False
) -> int | None:
    """The receiver's side: returns the sender's latest version. ``Refused`` (one line) when
    the sender refuses this receiver or cannot prove the secret itself."""
    kind, hello = conn.recv(deadline, HANDSHAKE_LIMIT)
    if kind != HELLO or not bytes(hello).startswith(MAGIC) or len(hello) != len(MAGIC) + NONCE_LEN:
        raise Refused(f"{conn.peer} is not a forgerl delta sender (or another version of it)")
    server_nonce = bytes(hello[len(MAGIC) :])
    client_nonce = os.urandom(NONCE_LEN)
    tag = _mac(key, b"join", server_nonce, client_nonce, worker.encode())
    conn.send_json(
        JOIN, {"worker": worker, "nonce": client_nonce.hex(), "tag": tag.hex(), "query": query}, deadline
    )
    kind, payload = conn.recv(deadline, HANDSHAKE_LIMIT)
    if kind == REFUSE:
        why = bytes(payload[:200]).decode(errors="replace")
        raise Refused(f"the delta sender at {conn.peer} refused worker {worker!r}: {why}")
    try:
        welcome = json.loads(bytes(payload))
        proof = bytes.fromhex(welcome["tag"])
    except (ValueError, KeyError, TypeError):
        kind = -1
    if kind != WELCOME or not hmac.compare_digest(proof, _mac(key, b"welcome", client_nonce, server_nonce)):
        raise Refused(f"the delta sender at {conn.peer} does not hold this run's transport secret")
    conn.authenticate(_mac(key, b"session", server_nonce, client_nonce))
    latest = welcome.get("latest")
    return None if latest is None else int(latest)
