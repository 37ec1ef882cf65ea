"""A thin owner of one Mooncake ``TransferEngine`` and the memory it registered.

Mooncake is imported here only, lazily. ``protocol="rdma"`` uses RDMA NICs where the
machine has them and falls back to TCP by itself where it has none, so the same call runs
in CI and on a cluster. ``P2PHANDSHAKE`` metadata needs no etcd: a peer is named
``host:rpc_port`` and the engines exchange segment descriptors directly.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from forgerl.errors import TransportError

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, address: str, protocol: str, device_name: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # pragma: no cover - the backend's `requires` checks first
            raise TransportError(
                "the rdma transport needs Mooncake: pip install 'forgerl[rdma]' "
                "(mooncake-transfer-engine-non-cuda; on GPU machines forgerl[rdma-gpu])"
            ) from exc
        self.address = address
        self._engine = TransferEngine()
        rc = self._engine.initialize(address, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportError(
                f"Mooncake TransferEngine.initialize({address!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) failed with {rc}; check transport.options.host and device_name"
            )
        self.session = f"{address}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())

    def register(self, tensor: Any) -> None:
        """Register a tensor's memory (kept alive by the caller until :meth:`unregister`)."""
        ptr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        location = f"cuda:{tensor.device.index or 0}" if tensor.is_cuda else "*"
        with self._lock:
            rc = self._engine.register_memory(ptr, n, location)
            if rc != 0:
                raise TransportError(f"Mooncake could not register {n} bytes at {ptr:#x} ({location}): {rc}")
            self._registered[ptr] = n

    def unregister(self, tensor_or_ptr: Any) -> None:
        ptr = tensor_or_ptr if isinstance(tensor_or_ptr, int) else tensor_or_ptr.data_ptr()
        with self._lock:
            if self._registered.pop(ptr, None) is None:
                return
            rc = self._engine.unregister_memory(ptr)
        if rc != 0:
            log.warning("rdma: unregistering %#x failed with %d", ptr, rc)

    def read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """One-sided read of ``remote`` ranges of ``session`` into ``local``; 0 on success."""
        if not lengths:
            return 0
        return int(self._engine.batch_transfer_sync_read(session, local, remote, lengths))

    def close(self) -> None:
        """Unregister everything, then drop the engine (its listening ports close)."""
        for ptr in list(self._registered):
            self.unregister(ptr)
        self._engine = None
