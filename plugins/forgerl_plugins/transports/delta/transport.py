"""The ``delta`` transport: per version, only the bytes that changed against the version
each receiver holds, over one TCP port authenticated with the run's secret.

Between two RL steps most bf16 weights do not change (an update below half a bf16 ulp
rounds away), so a version is sent as the elements that changed against the receiver's
base, per block (:mod:`.encoding`). A new or restarted receiver's base is the model folder
its generator loaded, when its files give the trainer's starting weights (:mod:`.seed`).
A version goes whole whenever in doubt: to a receiver with no base, after the trainer
resumes (it holds no bases), when the receiver's base is not
the sender's (digest), when a delta is refused (checksum mismatch), and when the delta
would not be smaller. The sender is :mod:`.sender`, the receiver :mod:`.receiver`, the
frames and the handshake :mod:`.wire` (docs/transports.md, "delta").

One port, one direction of connection (receivers connect to the trainer): the path that
works between clusters, through a port the user opens.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any, TypeAlias

from forgerl.errors import TransportError
from forgerl.interfaces import Transport
from forgerl_plugins.transports.common.control import bind_address, client_address
from forgerl_plugins.transports.common.settings import RunSettings
from forgerl_plugins.transports.delta import wire
from forgerl_plugins.transports.delta.options import Options as _Options
from forgerl_plugins.transports.delta.receiver import DeltaReceiver
from forgerl_plugins.transports.delta.sender import DeltaSender

__all__ = ["DeltaReceiver", "DeltaSender", "DeltaTransport"]

class DeltaTransport(RunSettings, Transport):
    """Factory ``DeltaTransport(options, *, context)``. On the trainer, ``sender()`` (or
    ``receiver_spec()``) opens the port; receivers elsewhere are built with
    ``context=None`` from that spec (host, port, the run's secret)."""

    name = "delta"
    description = (
        "only the changed bytes per version (xor + zstd against the receiver's base) over one TCP port"
    )
    requires = ("torch", "zstandard", "xxhash")
    extra = "delta"

    Options: TypeAlias = _Options

    def __init__(self, options: Any, *, context: Any = None) -> None:
        self.options = options
        self.ctx = context
        self._sender: DeltaSender | None = None
        self._secret: str | None = None
        self._lock = threading.Lock()

    def sender(self) -> DeltaSender:
        key = wire.run_key(self.secret())
        with self._lock:
            if self._sender is None:
                self._sender = DeltaSender(
                    self.options, self._listen(), self.default_timeout(), key, self._release, self._seed_path()
                )
            return self._sender

    def _seed_path(self) -> Path | None:
        """The folder the trainer started from (the run's model), when seeding is on."""
        path = getattr(self.ctx, "model_path", None)
        return Path(path) if self.options.seed and path is not None else None

    def _listen(self) -> socket.socket:
        address = bind_address(self.options.host)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, self.options.port))
        except OSError as exc:
            sock.close()
            raise TransportError(
                f"delta transport: cannot listen on {address}:{self.options.port}: {exc.strerror or exc}"
            ) from exc
        sock.listen(128)
        return sock

    def _release(self) -> None:
        with self._lock:
            self._sender = None

    def receiver_spec(self) -> dict[str, Any]:
        """Where the sender listens and the secret: hand it to receivers in their request or
        configuration, never on a command line."""
        port = self.sender().port
        if self.options.advertise:
            host, _, told = self.options.advertise.rpartition(":")
            return {"host": host.strip("[]"), "port": int(told), "secret": self.secret()}
        return {"host": self.options.host, "port": port, "secret": self.secret()}

    def receiver(self, worker_id: str, spec: Any = None) -> DeltaReceiver:
        host, port, secret = self._sender_address(spec)
        return DeltaReceiver(
            self.options, worker_id, host, port, self.default_timeout(), wire.run_key(secret)
        )

    def _sender_address(self, spec: Any) -> tuple[str, int, str]:
        if spec and spec.get("port"):
            secret = spec.get("secret") or (self.secret() if self.options.secret_file else None)
            if not secret:
                raise TransportError(
                    "delta receiver refused: its spec carries no transport secret; build it from the sender's "
                    "receiver_spec(), which carries the run's secret"
                )
            return str(spec.get("host") or self.options.host), int(spec["port"]), str(secret)
        if self.options.advertise and (self._sender is not None or self.options.port):
            host, _, port = self.options.advertise.rpartition(":")
            return host.strip("[]"), int(port), self.secret()
        if self._sender is not None:
            return client_address(bind_address(self.options.host)), self._sender.port, self.secret()
        if self.options.port:
            if self.ctx is None and not self.options.secret_file:
                raise TransportError(
                    "delta receiver refused: without the sender's receiver_spec() it needs the run's transport "
                    "secret: set transport.options.secret_file, or build it with the run context"
                )
            return self.options.host, self.options.port, self.secret()
        raise TransportError(
            "delta receiver does not know where the sender is: pass the sender's receiver_spec() or set "
            "transport.options.host and transport.options.port"
        )

    def close(self) -> None:
        with self._lock:
            sender = self._sender
        if sender is not None:
            sender.close()
