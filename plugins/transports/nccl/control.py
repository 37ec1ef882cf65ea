"""The control channel of a transport: a torch ``TCPStore`` hosted by the sender.

Receivers register themselves, ask for versions and acknowledge them through it; the
sender publishes each version's layout (names, dtypes, shapes, offsets) in it. Data never
goes through the store. Every call is bounded: :class:`Control` sets the store's timeout
from the caller's :class:`Deadline` before each operation, so a frozen or dead sender
turns into a timeout, never a hang.

Used by the ``nccl`` and ``rdma`` transports, which also share what is built on it here:
receiver registration (:func:`join`) and the transport object that hosts the store on
the trainer and tells receivers where it is (:class:`StoreHostedTransport`).

The store listens on the run's interface only (loopback unless ``options.host`` names
another address), and every value in it is signed with the run's secret (:mod:`.auth`):
whoever reaches the port without the secret can neither join nor make a receiver act on
anything it wrote.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from forgerl.errors import TransportError
from forgerl_plugins.transports.nccl.auth import PROOF_KEY, PROOF_VALUE, ForgedValue, Signer

log = logging.getLogger(__name__)

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


# ===================================================================== membership


def member_key(nonce: str, what: str) -> str:
    """A key about one registered receiver (``ack``, ``closed``, offers...)."""
    return f"m/{nonce}/{what}"


def log_refused(ctl: Control, transport: str) -> None:
    """Say so when someone without the secret queued a message (a registration, mostly)."""
    for tail in ctl.refused:
        log.warning(
            "%s: refused a message not signed with the run's transport secret (someone without it "
            "reached the control store): ...%r",
            transport,
            tail[-120:],
        )
    ctl.refused.clear()


def check_sender(ctl: Control, deadline: Deadline | None = None) -> None:
    """Refuse to go on unless the store's sender signed its proof with our secret: a
    receiver with a wrong secret learns so at once, in words (TransportError, not a
    store error, so no retry loop swallows it)."""
    host, port = ctl._address
    try:
        proof = ctl.get(PROOF_KEY, deadline)
    except ForgedValue:
        raise TransportError(
            f"the transport sender at {host}:{port} refused this receiver: its secret does not match the "
            "run's (the receiver must be built from this run's receiver_spec(), which carries the secret)"
        ) from None
    if proof != PROOF_VALUE:
        raise TransportError(
            f"the control store at {host}:{port} does not prove the run's transport secret: it is not "
            "this run's sender (a stale address, or a forgerl too old to sign its store)"
        )


def join(ctl: Control, events: str, worker_id: str, sender_host: str, deadline: Deadline) -> str:
    """Register a receiver with the sender: check the sender's proof, then a fresh nonce
    (one per incarnation, so a restarted worker is a new member), its ``ack`` key at -1,
    and a signed ``join`` event on the ``events`` queue naming the worker, its pid and
    the address it reaches the sender from (what the sender's errors name). Returns the
    nonce."""
    check_sender(ctl, deadline)
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

    The secret that signs the store's values is the run's (``<run_dir>/transport.secret``)
    when there is a run context, else one made for this object; ``receiver_spec()``
    carries it to receivers in other processes.

    Subclasses set ``name``, ``namespace`` and the classes of their two halves, which
    take the same constructor arguments in both transports.
    """

    name = ""
    namespace = ""
    #: ``sender_class(options, store_server, store_host, port, timeout, release, signer)``
    sender_class: Any = None
    #: ``receiver_class(options, worker_id, host, port, timeout, secret)``
    receiver_class: Any = None

    def sender(self) -> Any:
        from forgerl_plugins.transports.nccl.auth import Signer

        server, port = self._hosted()
        return self.sender_class(
            self.options,
            server,
            self.store_host,
            port,
            self.default_timeout(),
            self._release,
            Signer(self.secret()),
        )

    def receiver(self, worker_id: str, spec: Any = None) -> Any:
        host, port, secret = self._sender_address(spec)
        return self.receiver_class(self.options, worker_id, host, port, self.default_timeout(), secret)

    def __init__(self, options: Any, *, context: Any = None) -> None:
        self.options = options
        self.ctx = context
        self._server: Any = None
        self._port: int | None = None
        self._secret: str | None = None
        self._lock = threading.Lock()

    def default_timeout(self) -> float:
        """The transport's own ``timeout`` option, else the run's ``transport.timeout``."""
        if self.options.timeout is not None:
            return float(self.options.timeout)
        if self.ctx is not None:
            return float(self.ctx.config.transport.timeout)
        return DEFAULT_TIMEOUT

    def secret(self) -> str:
        """``options.secret_file``'s, else the run's (from the run directory), else this
        object's own (no run: it reaches receivers through :meth:`receiver_spec`)."""
        with self._lock:
            if self._secret is None:
                from forgerl_plugins.transports.nccl import auth

                if self.options.secret_file:
                    self._secret = auth.secret_from_file(self.options.secret_file)
                elif self.ctx is not None:
                    self._secret = auth.run_secret(self.ctx.run_dir)
                else:
                    self._secret = auth.new_secret()
            return self._secret

    @property
    def store_host(self) -> str:
        """How this process reaches the store it hosts (its bind address)."""
        return client_address(bind_address(self.options.host))

    def _hosted(self) -> tuple[Any, int]:
        """The store this process hosts (started now if need be) and its port."""
        secret = self.secret()
        with self._lock:
            if self._server is None:
                server = start_server(self.options.port, self.options.connect_timeout, self.options.host)
                # Before anyone learns the port: a receiver checks this first.
                Control(server, self.namespace, Signer(secret)).set(PROOF_KEY, PROOF_VALUE)
                self._server, self._port = server, int(server.port)
            assert self._port is not None
            return self._server, self._port

    def _release(self) -> None:
        """Called by the sender when it closes: the store goes with it."""
        with self._lock:
            self._server = None

    def receiver_spec(self) -> dict[str, Any]:
        """Where the store is and the secret to talk to it: hand it to receivers in their
        request or configuration, never on a command line (``ps`` shows those to all)."""
        return {"host": self.options.host, "port": self._hosted()[1], "secret": self.secret()}

    def _sender_address(self, spec: Any) -> tuple[str, int, str]:
        """Where a receiver reaches the store, and the secret: the spec, this process's
        own store, or the fixed address in the options with the run's secret."""
        if spec and spec.get("port"):
            secret = spec.get("secret") or (self.secret() if self.options.secret_file else None)
            if not secret:
                raise TransportError(
                    f"{self.name} receiver refused: its spec carries no transport secret; build it from the "
                    "sender's receiver_spec(), which carries the run's secret"
                )
            return str(spec.get("host") or self.options.host), int(spec["port"]), str(secret)
        if self._server is not None:
            return self.store_host, int(self._port or 0), self.secret()
        if self.options.port:
            if self.ctx is None and not self.options.secret_file:
                raise TransportError(
                    f"{self.name} receiver refused: without the sender's receiver_spec() it needs the run's "
                    "transport secret: set transport.options.secret_file, or build it with the run context"
                )
            return self.options.host, self.options.port, self.secret()
        raise TransportError(
            f"{self.name} receiver does not know where the sender is: pass the sender's receiver_spec() "
            "or set transport.options.host and transport.options.port"
        )

    def close(self) -> None:
        self._release()
