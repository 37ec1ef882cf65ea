"""The control channel of a transport: a torch ``TCPStore`` hosted by the sender.

Receivers register themselves, ask for versions and acknowledge them through it; the
sender publishes each version's layout (names, dtypes, shapes, offsets) in it. Data never
goes through the store. Every call is bounded: :class:`Control` sets the store's timeout
from the caller's :class:`Deadline` before each operation, so a frozen or dead sender
turns into a timeout, never a hang.

Used by the ``nccl`` and ``rdma`` transports, which also share what is built on it here:
receiver registration (:func:`join`) and the transport object that hosts the store on
the trainer and tells receivers where it is (:class:`StoreHostedTransport`).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from forgerl.errors import TransportError

#: Errors the store raises when its peer is gone, slow, or a key is missing in time.
#: (torch's DistError and friends derive from RuntimeError.)
STORE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError)

#: Longest single store operation: a store op that takes longer means the other side froze.
MAX_OP_SECONDS = 10.0
#: Shortest bound given to one store operation, however little of a deadline is left.
MIN_OP_SECONDS = 2.0


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


def start_server(port: int, timeout: float) -> Any:
    """A TCPStore server on ``port`` (0: any free port). Closing it = dropping every
    reference to it (and to stores/groups built on it)."""
    from torch.distributed import TCPStore

    # The server listens on every interface; ``host`` here is only how this process
    # reaches it as a client.
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(timeout))


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

    def __init__(self, store: Any, namespace: str, host: str | None = None, port: int | None = None) -> None:
        self.namespace = namespace
        self._address = (host, port)
        self._use(store)
        self._broken = False

    def _use(self, store: Any) -> None:
        from torch.distributed import PrefixStore

        self.raw = store
        self.store = PrefixStore(self.namespace, store)

    @classmethod
    def connect(cls, host: str, port: int, namespace: str, timeout: float) -> Control:
        return cls(connect(host, port, min(timeout, MAX_OP_SECONDS)), namespace, host, port)

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
        self._call(deadline, self.store.set, key, value)

    def set_json(self, key: str, value: Any, deadline: Deadline | None = None) -> None:
        self.set(key, json.dumps(value, separators=(",", ":")), deadline)

    def has(self, key: str, deadline: Deadline | None = None) -> bool:
        return bool(self._call(deadline, self.store.check, [key]))

    def get(self, key: str, deadline: Deadline | None = None) -> bytes | None:
        """The value, or None when the key does not exist (never waits for it)."""
        if not self.has(key, deadline):
            return None
        return self._call(deadline, self.store.get, key)

    def get_json(self, key: str, deadline: Deadline | None = None) -> Any:
        raw = self.get(key, deadline)
        return None if raw is None else json.loads(raw)

    def get_many(self, keys: list[str], deadline: Deadline | None = None) -> list[bytes]:
        """Values of keys that must all exist (one round trip)."""
        if not keys:
            return []
        return list(self._call(deadline, self.store.multi_get, keys))

    def compare_set(self, key: str, expected: str, desired: str, deadline: Deadline | None = None) -> str:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` ("" = absent);
        returns the value it holds afterwards (``desired`` when this call won)."""
        return self._call(deadline, self.store.compare_set, key, expected, desired).decode()

    def delete(self, keys: Iterable[str], deadline: Deadline | None = None) -> None:
        for key in keys:
            self._call(deadline, self.store.delete_key, key)

    def push(self, queue: str, value: Any, deadline: Deadline | None = None) -> None:
        self._call(deadline, self.store.queue_push, queue, json.dumps(value, separators=(",", ":")))

    def pop_all(self, queue: str, deadline: Deadline | None = None) -> list[Any]:
        """Every value queued now, oldest first (never waits)."""
        n = int(self._call(deadline, self.store.queue_len, queue))
        return [json.loads(self._call(deadline, self.store.queue_pop, queue, False)) for _ in range(n)]


# ===================================================================== membership


def member_key(nonce: str, what: str) -> str:
    """A key about one registered receiver (``ack``, ``closed``, offers...)."""
    return f"m/{nonce}/{what}"


def join(ctl: Control, events: str, worker_id: str, sender_host: str, deadline: Deadline) -> str:
    """Register a receiver with the sender: a fresh nonce (one per incarnation, so a
    restarted worker is a new member), its ``ack`` key at -1, and a ``join`` event on the
    ``events`` queue naming the worker, its pid and the address it reaches the sender
    from (what the sender's errors name). Returns the nonce."""
    nonce = uuid.uuid4().hex[:16]
    ctl.set(member_key(nonce, "ack"), "-1", deadline)
    event = {
        "type": "join",
        "nonce": nonce,
        "worker_id": worker_id,
        "pid": os.getpid(),
        "host": local_address(sender_host),
    }
    ctl.push(events, event, deadline)
    return nonce


# ====================================================== the transport object around it

#: Seconds a send or receive may take when neither the options nor the run say.
DEFAULT_TIMEOUT = 120.0


def short(exc: BaseException) -> str:
    """First line of an exception (torch's store errors carry C++ stack traces)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


class StoreHostedTransport:
    """What the ``nccl`` and ``rdma`` transport objects share: the trainer side hosts the
    control store (started on the first ``sender()`` or ``receiver_spec()``), and a
    receiver in another process finds it through :meth:`receiver_spec`, or through
    ``options.host``/``options.port`` when the store listens on a fixed port.

    Subclasses set ``name`` and build their sender and receiver from :meth:`_hosted`
    and :meth:`_sender_address`.
    """

    name = ""

    def __init__(self, options: Any, ctx: Any = None) -> None:
        self.options = options
        self.ctx = ctx
        self._server: Any = None
        self._port: int | None = None
        self._lock = threading.Lock()

    def default_timeout(self) -> float:
        """The transport's own ``timeout`` option, else the run's ``transport.timeout``."""
        if self.options.timeout is not None:
            return float(self.options.timeout)
        if self.ctx is not None:
            return float(self.ctx.config.transport.timeout)
        return DEFAULT_TIMEOUT

    def _hosted(self) -> tuple[Any, int]:
        """The store this process hosts (started now if need be) and its port."""
        with self._lock:
            if self._server is None:
                self._server = start_server(self.options.port, self.options.connect_timeout)
                self._port = int(self._server.port)
            assert self._port is not None
            return self._server, self._port

    def _release(self) -> None:
        """Called by the sender when it closes: the store goes with it."""
        with self._lock:
            self._server = None

    def receiver_spec(self) -> dict[str, Any]:
        return {"host": self.options.host, "port": self._hosted()[1]}

    def _sender_address(self, spec: Any) -> tuple[str, int]:
        """Where a receiver reaches the store: the spec, this process's own store, or
        the fixed address in the options."""
        if spec and spec.get("port"):
            return str(spec.get("host") or self.options.host), int(spec["port"])
        if self._server is not None:
            return "127.0.0.1", int(self._port or 0)
        if self.options.port:
            return self.options.host, self.options.port
        raise TransportError(
            f"{self.name} receiver does not know where the sender is: pass the sender's receiver_spec() "
            "or set transport.options.host and transport.options.port"
        )

    def close(self) -> None:
        self._release()
