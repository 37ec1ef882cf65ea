"""The transport object of a store-hosted transport (``nccl``, ``rdma``): on the trainer
it hosts the control store (:mod:`.control`) and builds the sender; in a generator
worker's process it builds receivers that find the store through the sender's
``receiver_spec()``.
"""

from __future__ import annotations

import threading
from typing import Any

from forgerl.errors import TransportError
from forgerl_plugins.transports.common.auth import PROOF_KEY, PROOF_VALUE, Signer
from forgerl_plugins.transports.common.control import Control, bind_address, client_address, start_server
from forgerl_plugins.transports.common.settings import RunSettings


class StoreHostedTransport(RunSettings):
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
