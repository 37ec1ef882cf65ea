"""The control channel of a transport: a torch ``TCPStore`` hosted by the sender.

Receivers register themselves, ask for versions and acknowledge them through it; the
sender publishes each version's layout (names, dtypes, shapes, offsets) in it. Data never
goes through the store. Every call is bounded: :class:`Control` sets the store's timeout
from the caller's :class:`Deadline` before each operation, so a frozen or dead sender
turns into a timeout, never a hang.

Used by the ``nccl`` and ``rdma`` transports, which also share what is built on it:
receiver registration and acknowledgements (:mod:`.membership`) and the transport object
that hosts the store on the trainer and tells receivers where it is (:mod:`.hosting`).

The store listens on the run's interface only (loopback unless ``options.host`` names
another address), and every value in it is signed with the run's secret (:mod:`.auth`):
whoever reaches the port without the secret can neither join nor make a receiver act on
anything it wrote.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from forgerl.errors import TransportError
from forgerl_plugins.transports.common.auth import ForgedValue, Signer

#: Errors the store raises when its peer is gone, slow, or a key is missing in time.
#: (torch's DistError and friends derive from RuntimeError.)
STORE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError)

#: Longest single store operation: a store op that takes longer means the other side froze.
MAX_OP_SECONDS = 10.0
#: Shortest bound given to one store operation, however little of a deadline is left.
MIN_OP_SECONDS = 2.0
#: Bound of a single bookkeeping query made outside any caller's deadline.
MAX_QUERY = 5.0


class Deadline:
    """A point in time; ``remaining()`` seconds until it (never negative)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.remaining())))


class Backoff:
    """Sleeps of a polling loop: short right after something happened (the answer to a
    request usually comes quickly), doubling up to ``ceiling`` while nothing does."""

    FLOOR = 0.0005

    def __init__(self, ceiling: float) -> None:
        self.ceiling = max(self.FLOOR, ceiling)
        self.current = self.FLOOR

    def reset(self) -> None:
        self.current = self.FLOOR

    def next(self) -> float:
        seconds = self.current
        self.current = min(self.ceiling, self.current * 2)
        return seconds

    def sleep(self, deadline: Deadline | None = None) -> None:
        seconds = self.next()
        time.sleep(seconds if deadline is None else max(0.0, min(seconds, deadline.remaining())))


def timedelta(seconds: float) -> datetime.timedelta:
    # The store refuses a zero timeout; 50 ms is the shortest wait that still lets a
    # healthy round trip succeed on a busy machine.
    return datetime.timedelta(seconds=max(0.05, float(seconds)))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address(peer_host: str) -> str:
    """The address of this machine that ``peer_host`` can reach (loopback for a loopback
    peer; otherwise the source address the kernel would use to reach it)."""
    if is_loopback(peer_host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def sender_address(host: str) -> str:
    """The address a sender's data channels (gloo listeners, Mooncake's engine) use on
    the machine receivers reach as ``host``: ``host`` itself, loopback for a loopback name."""
    return local_address(host) if is_loopback(host) else host


def bind_address(host: str) -> str:
    """The address a store for receivers reaching ``host`` listens on: loopback for a
    loopback host, the host's own address otherwise (``0.0.0.0``/``::`` only when the
    configuration says so). Never all interfaces by default."""
    if host in ("", "0.0.0.0", "::"):
        return host or "0.0.0.0"
    if is_loopback(host):
        return "::1" if host == "::1" else "127.0.0.1"
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise TransportError(f"transport.options.host={host!r} does not resolve: {exc}") from exc


def client_address(bound: str) -> str:
    """How this process reaches a store bound to ``bound``."""
    if bound in ("0.0.0.0", ""):
        return "127.0.0.1"
    return "::1" if bound == "::" else bound


def start_server(port: int, timeout: float, host: str = "127.0.0.1") -> Any:
    """A TCPStore server on ``bind_address(host)``:``port`` (0: any free port). Closing it
    = dropping every reference to it (and to stores/groups built on it)."""
    from torch.distributed import TCPStore

    # TCPStore itself listens on every interface; a socket we bind and hand over as
    # ``master_listen_fd`` (libuv backend) keeps it on the run's interface.
    address = bind_address(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            raise TransportError(
                f"the transport's control store cannot listen on {address}:{port} ({exc.strerror or exc}): "
                "transport.options.host must be an address of the trainer's rank-0 machine "
                "(and the port free)"
            ) from exc
        sock.listen(512)
        bound_port = int(sock.getsockname()[1])
        # The store owns (and closes) the descriptor it is given: give it a duplicate and
        # let ours close with this block.
        return TCPStore(
            client_address(address),
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(timeout),
            master_listen_fd=os.dup(sock.fileno()),
            use_libuv=True,
        )


def connect(host: str, port: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    # TCPStore retries a refused connection until its timeout (and past it, on a busy
    # machine); a plain connect first makes "nobody listens there" fail at once.
    with socket.create_connection((host, port), timeout=max(0.05, min(timeout, 5.0))):
        pass
    return TCPStore(host, port, is_master=False, timeout=timedelta(timeout))


class Control:
    """A namespaced view of the control store with a bound on every operation.

    Two rules learnt the hard way: a TCPStore client whose operation timed out is left
    out of step with its server (the late reply answers the next request), so after any
    failed operation the connection is replaced before the next one; and operations get
    at least ``MIN_OP_SECONDS`` even when the caller's deadline is nearly spent, because a
    timeout that fires on a healthy but busy server breaks the connection for nothing.
    Callers bound their own loops by their deadlines.

    Not thread-safe: each thread that talks to the store makes its own ``Control``.
    """

    def __init__(
        self, store: Any, namespace: str, signer: Signer, host: str | None = None, port: int | None = None
    ) -> None:
        self.namespace = namespace
        self.signer = signer
        self._address = (host, port)
        self._use(store)
        self._broken = False
        #: Tails of unsigned queue entries dropped by :meth:`pop_all` (the caller logs them).
        self.refused: list[bytes] = []

    def _use(self, store: Any) -> None:
        from torch.distributed import PrefixStore

        self.raw = store
        self.store = PrefixStore(self.namespace, store)

    @classmethod
    def connect(cls, host: str, port: int, namespace: str, timeout: float, signer: Signer) -> Control:
        return cls(connect(host, port, min(timeout, MAX_OP_SECONDS)), namespace, signer, host, port)

    # Values are signed over the full key (namespace included): a signed value copied to
    # another key, or to another transport's namespace, does not verify.
    def _seal(self, key: str, value: str | bytes) -> bytes:
        return self.signer.seal(self.namespace + key, value)

    def _open(self, key: str, sealed: bytes) -> bytes:
        return self.signer.open(self.namespace + key, sealed)

    def _call(self, deadline: Deadline | None, fn: Any, *args: Any) -> Any:
        if self._broken:
            host, port = self._address
            if host is None or port is None:
                raise RuntimeError("control store connection broke and cannot be re-established")
            self._use(connect(host, port, MAX_OP_SECONDS))
            self._broken = False
        seconds = MAX_OP_SECONDS if deadline is None else min(MAX_OP_SECONDS, deadline.remaining())
        # On the TCPStore itself: a PrefixStore's own timeout does not reach its socket.
        self.raw.set_timeout(timedelta(max(MIN_OP_SECONDS, seconds)))
        try:
            return fn(*args)
        except STORE_ERRORS:
            self._broken = True
            raise

    def set(self, key: str, value: str | bytes, deadline: Deadline | None = None) -> None:
        self._call(deadline, self.store.set, key, self._seal(key, value))

    def set_json(self, key: str, value: Any, deadline: Deadline | None = None) -> None:
        self.set(key, json.dumps(value, separators=(",", ":")), deadline)

    def has(self, key: str, deadline: Deadline | None = None) -> bool:
        return bool(self._call(deadline, self.store.check, [key]))

    def get(self, key: str, deadline: Deadline | None = None) -> bytes | None:
        """The value, or None when the key does not exist (never waits for it)."""
        if not self.has(key, deadline):
            return None
        return self._open(key, self._call(deadline, self.store.get, key))

    def get_json(self, key: str, deadline: Deadline | None = None) -> Any:
        raw = self.get(key, deadline)
        return None if raw is None else json.loads(raw)

    def get_many(self, keys: list[str], deadline: Deadline | None = None) -> list[bytes]:
        """Values of keys that must all exist (one round trip)."""
        if not keys:
            return []
        return [self._open(k, v) for k, v in zip(keys, self._call(deadline, self.store.multi_get, keys))]

    def compare_set(self, key: str, expected: str, desired: str, deadline: Deadline | None = None) -> str:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` ("" = absent);
        returns the value it holds afterwards (``desired`` when this call won)."""
        if expected:
            raise ValueError("compare_set of signed values compares only against an absent key")
        got = self._call(deadline, self.store.compare_set, key, "", self._seal(key, desired))
        return self._open(key, got).decode()

    def delete(self, keys: Iterable[str], deadline: Deadline | None = None) -> None:
        for key in keys:
            self._call(deadline, self.store.delete_key, key)

    def push(self, queue: str, value: Any, deadline: Deadline | None = None) -> None:
        sealed = self._seal(queue, json.dumps(value, separators=(",", ":")))
        self._call(deadline, self.store.queue_push, queue, sealed)

    def pop_all(self, queue: str, deadline: Deadline | None = None) -> list[Any]:
        """Every signed value queued now, oldest first (never waits). Unsigned ones (a
        stranger's) are dropped, counted in ``refused`` and logged by the caller."""
        n = int(self._call(deadline, self.store.queue_len, queue))
        out = []
        for _ in range(n):
            raw = self._call(deadline, self.store.queue_pop, queue, False)
            try:
                out.append(json.loads(self._open(queue, raw)))
            except ForgedValue:
                self.refused.append(bytes(raw[-200:]))
        return out


def short(exc: BaseException) -> str:
    """First line of an exception (torch's store errors carry C++ stack traces)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
