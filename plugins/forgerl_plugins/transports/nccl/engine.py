"""The ``nccl`` transport's receivers for engines that receive broadcasts themselves
(SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``).

Each engine instance gets a group of its own with the sender (rank 0) and its ``ranks``
workers (ranks 1..ranks), as the transport's other receivers each get their own channel:
a dead engine breaks only its group, a restarted one joins a new one. The group is built
the way SGLang builds its side (``torch.distributed``'s ``rendezvous`` on
``tcp://address:port``, whose store rank 0 hosts, a ``PrefixStore`` named after the group,
then torch's process-group helper), so that both sides meet on the same keys.

The handle lives in the sender's process. ``send`` publishes each version on the
transport's :class:`EngineBoard` and waits until every engine receiver registered then
has taken it (or failed, or the timeout passed); the generator's update thread, in
:meth:`NcclBroadcastEngineReceiver.receive`, takes the version's tensors from the board
and broadcasts them bucket by bucket while it has the engine receive each bucket.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import BroadcastEngineReceiver, TensorSpec
from forgerl_plugins.transports.common.control import Deadline

from . import groups

DEFAULT_TIMEOUT = 120.0


class EngineBoard:
    """Where ``send`` leaves each version for the engine receivers, and waits for them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version: int | None = None
        self.tensors: list[tuple[str, Any]] = []
        self.receivers: dict[str, NcclBroadcastEngineReceiver] = {}

    def publish(self, version: int, tensors: list[tuple[str, Any]]) -> list[NcclBroadcastEngineReceiver]:
        """Make ``version`` current; the receivers it is owed to (those registered now)."""
        with self.cond:
            self.version, self.tensors = version, tensors
            self.cond.notify_all()
            return [r for r in self.receivers.values() if r.failed is None]

    def wait(self, version: int, targets: list[NcclBroadcastEngineReceiver], deadline: float) -> list[str]:
        """Wait until each target took ``version`` or failed; what went wrong, per receiver."""
        with self.cond:
            while time.monotonic() < deadline:
                if all(r.delivered == version or r.failed for r in targets):
                    break
                self.cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            return [
                f"{r.worker_id}: {r.failed or 'did not take it in time'}"
                for r in targets
                if r.delivered != version
            ]


class NcclBroadcastEngineReceiver(BroadcastEngineReceiver):
    """One engine instance's group (see the module docstring)."""

    def __init__(
        self, board: EngineBoard, worker_id: str, ranks: int, backend: str, address: str,
        bucket_bytes: int, timeout: float,
    ) -> None:  # fmt: skip
        self.board = board
        self.worker_id = worker_id
        self.ranks = int(ranks)
        self.backend = groups.resolve_backend(backend)
        self.address = address
        self.port = _free_port(address)
        self.name = f"forge-{uuid.uuid4().hex[:12]}"
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.delivered: int | None = None
        self.failed: str | None = None
        self._pg: Any = None
        with board.cond:
            board.receivers[self.name] = self

    def group(self) -> dict[str, Any]:
        return {
            "master_address": self.address,
            "master_port": self.port,
            "world_size": 1 + self.ranks,
            "rank_offset": 1,
            "group_name": self.name,
            "backend": self.backend,
        }

    def latest_version(self) -> int | None:
        return self.board.version

    def connect(self, timeout: float | None = None) -> None:
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

        from forgerl_plugins.transports.common.control import start_server

        seconds = self.timeout if timeout is None else timeout
        wait = timedelta(seconds=seconds)
        try:
            # The store the engine's ``rendezvous`` on tcp://address:port connects to, hosted
            # here as rank 0. Not through ``rendezvous`` ourselves: its TCPStore would listen
            # on every interface (docs/security.md: the run's interface only).
            store = start_server(self.port, seconds, self.address)  # its timeout: ``seconds``
            made = _new_process_group_helper(
                1 + self.ranks, 0, [], Backend(self.backend), PrefixStore(self.name, store),
                group_name=self.name, timeout=wait,  # type: ignore[arg-type]
            )  # fmt: skip
        except Exception as exc:  # torch raises RuntimeError / DistStoreError on a timeout
            self._fail(f"the engine did not join its group: {type(exc).__name__}: {exc}")
            raise TransportTimeout(
                f"{self.worker_id}: the engine did not join weight group {self.name} within {seconds:g} s ({exc})"
            ) from exc
        self._pg = made[0] if isinstance(made, tuple) else made

    def receive(self, version: int, timeout: float | None = None) -> Iterator[list[TensorSpec]]:
        if self._pg is None or self.failed:
            raise TransportError(f"{self.worker_id}: not connected ({self.failed or 'connect() first'})")
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        with self.board.cond:
            while self.board.version is None or self.board.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"{self.worker_id}: weights version {version} was not sent within {seconds:g} s"
                    )
                self.board.cond.wait(min(left, 0.5))
            if self.board.version != version:
                raise TransportError(
                    f"{self.worker_id}: weights version {version} is gone (the sender is at "
                    f"{self.board.version}); ask for latest_version()"
                )
            tensors = list(self.board.tensors)
        return self._buckets(version, tensors, deadline)

    def _buckets(
        self, version: int, tensors: list[tuple[str, Any]], deadline: float
    ) -> Iterator[list[TensorSpec]]:
        import torch

        device = groups.device_for(self.backend)
        done = False
        try:
            for bucket in _split(tensors, self.bucket_bytes):
                specs = [
                    TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in bucket
                ]
                errors: list[BaseException] = []

                def push(
                    bucket: list[tuple[str, Any]] = bucket, errors: list[BaseException] = errors
                ) -> None:
                    try:
                        for _, t in bucket:
                            left = max(0.001, deadline - time.monotonic())
                            work = groups.broadcast(self._pg, t.to(device).contiguous(), 0, left)
                            groups.wait(work, Deadline(max(0.0, deadline - time.monotonic())))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                        errors.append(exc)

                thread = threading.Thread(target=push, name="forge-engine-broadcast", daemon=True)
                thread.start()
                yield specs  # the caller has the engine receive them meanwhile
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    raise TransportTimeout(
                        f"{self.worker_id}: a bucket of version {version} was not taken in time"
                    )
                if errors:
                    raise TransportError(f"{self.worker_id}: broadcast failed: {errors[0]}") from errors[0]
            done = True
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            if done:
                with self.board.cond:
                    self.delivered = version
                    self.board.cond.notify_all()
            else:  # left early, or failed: the group's state is unknown
                self._fail(f"weights version {version} was not taken whole")

    def _fail(self, why: str) -> None:
        with self.board.cond:
            if self.failed is None:
                self.failed = why
            self.board.cond.notify_all()
        holder = [self._pg]
        self._pg = None
        groups.destroy_soon(holder)

    def close(self) -> None:
        with self.board.cond:
            self.board.receivers.pop(self.name, None)
            self.board.cond.notify_all()
        if self._pg is not None:
            holder = [self._pg]
            self._pg = None
            groups.destroy_soon(holder)


def _split(tensors: list[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive runs of tensors of at most ``bucket_bytes`` (a bigger tensor alone)."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
