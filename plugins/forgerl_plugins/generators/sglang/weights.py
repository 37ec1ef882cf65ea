"""How one sglang replica loads a weight version.

The replica is paused by the update policy (``wait``: our requests on it drain, then
``/pause_generation`` in place; ``abort``: ``/pause_generation`` mode abort, and the
generator resubmits what was aborted), loads the version, has its cache flushed
(``/flush_cache``) and resumes (``/continue_generation``). SGLang receives the bytes
itself, so the run's transport gives an engine receiver per replica instance
(:class:`~forgerl.interfaces.EngineReceiver`):

* ``files`` (shm): the version staged alone in a folder → ``/update_weights_from_disk``;
* ``broadcast`` (nccl): the replica's workers join a group of their own with the trainer
  (``/init_weights_update_group``, once per server instance), then each bucket's names,
  dtypes and shapes go to ``/update_weights_from_distributed`` while the transport
  broadcasts its tensors.

Every load names the version (``weight_version``), which SGLang reports in each answer's
``meta_info``: a completion is checked against the version it was dispatched under.
Version 0 (a replica left behind by a failed load) is reloaded from the model folder.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from forgerl.errors import TransportError
from forgerl_plugins.generators.common.replica import Replica
from forgerl_plugins.generators.common.updates import WeightUpdates

from . import payloads
from .client import SGLangClient

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import EngineReceiver

    from .generator import SGLangGenerator

log = logging.getLogger(__name__)


class SGLangWeightUpdates(WeightUpdates):
    """The sglang generator's ``_update_replica`` (see the module docstring)."""

    options: SGLangGenerator.Options
    _client: SGLangClient
    weight_sync: str
    _receivers: dict[str, EngineReceiver]  # by "<replica>:<instance>"
    _joined: set[int]  # broadcast receivers whose engine joined their group

    async def _update_replica(self, r: Replica, version: int, policy: str | None = None) -> None:
        import httpx

        policy = policy or self.options.update_policy
        paused = False
        notice = self._pause_notice(r)  # its launcher must not take the pause for a hang
        try:
            if policy == "abort":
                r.aborts += 1  # before the pause: whatever is in flight now is resubmitted
            else:
                await r.idle.wait()  # our requests finish on the weights they started with
            await notice.start()
            await self._client.admin(r, "/pause_generation", json=payloads.pause_body(policy))
            paused = True
            await self._load(r, version)
        except httpx.HTTPError as exc:
            r.version = None  # it stopped answering mid-update: what it holds is unknown
            r.take_out(f"weight update: {type(exc).__name__}: {exc}")
            raise
        finally:
            try:
                if paused and r.up:
                    await self._client.admin(r, "/flush_cache")
                    await self._client.admin(r, "/continue_generation", json={})
            except httpx.HTTPError as exc:
                r.take_out(f"resume after update: {type(exc).__name__}")
            await notice.stop()
            r.updating = False

    async def _load(self, r: Replica, version: int) -> None:
        timeout = self.ctx.transport_timeout
        try:
            if version == 0:
                await self._client.load(
                    r,
                    "/update_weights_from_disk",
                    payloads.update_from_disk_body(str(self.ctx.model_path), 0),
                    timeout,
                )
            elif self.weight_sync == "files":
                await self._load_files(r, version, timeout)
            else:
                await self._load_broadcast(r, version, timeout)
        except TransportError:
            r.version = None  # SGLang may have loaded part of it: reload before serving
            raise
        r.version = version
        log.debug("sglang: replica %d loaded version %d", r.index, version)

    def _receiver(self, r: Replica) -> EngineReceiver:
        """The engine receiver of ``r``'s current server instance (a restarted server gets
        a new one: a broadcast group cannot take in a new member)."""
        key = f"{r.index}:{r.instance}"
        if key not in self._receivers:
            for old in [k for k in self._receivers if k.startswith(f"{r.index}:")]:
                self._receivers.pop(old).close()
            self._receivers[key] = self.transport.engine_receiver(
                f"sglang-{r.index}-{(r.instance or '')[:8]}",
                self.weight_sync,
                ranks=self.options.tensor_parallel_size,
            )
        return self._receivers[key]

    def _drop_receiver(self, r: Replica) -> None:
        """After a failed broadcast the group is broken: the next load joins a new one."""
        receiver = self._receivers.pop(f"{r.index}:{r.instance}", None)
        if receiver is not None:
            self._joined.discard(id(receiver))
            receiver.close()

    async def _load_files(self, r: Replica, version: int, timeout: float) -> None:
        from forgerl.interfaces import FilesEngineReceiver

        receiver = self._receiver(r)
        assert isinstance(receiver, FilesEngineReceiver)
        folder = await asyncio.to_thread(receiver.stage, version, timeout)
        try:
            await self._client.load(
                r, "/update_weights_from_disk", payloads.update_from_disk_body(str(folder), version), timeout
            )
        finally:
            receiver.release(version)

    async def _load_broadcast(self, r: Replica, version: int, timeout: float) -> None:
        from forgerl.interfaces import BroadcastEngineReceiver

        receiver = self._receiver(r)
        assert isinstance(receiver, BroadcastEngineReceiver)
        group = receiver.group()
        if id(receiver) not in self._joined:
            # Both sides block until the other has joined: the trainer's side in a thread.
            joining = asyncio.ensure_future(asyncio.to_thread(receiver.connect, timeout))
            try:
                await self._client.load(
                    r, "/init_weights_update_group", payloads.init_group_body(group), timeout
                )
            finally:
                await joining
            self._joined.add(id(receiver))
        it = iter(await asyncio.to_thread(receiver.receive, version, timeout))
        try:
            bucket = await asyncio.to_thread(next, it, None)
            while bucket is not None:
                # The transport broadcasts the bucket meanwhile; asking for the next one
                # waits for (and raises what went wrong with) this one's broadcast.
                body = payloads.update_distributed_body(bucket, group["group_name"])
                await self._client.load(r, "/update_weights_from_distributed", body, timeout)
                bucket = await asyncio.to_thread(next, it, None)
        except BaseException:
            close = getattr(it, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
            self._drop_receiver(r)
            raise
        # Named only once every bucket is in: a replica that failed half-way still reports
        # the old name (and is reloaded before it serves again).
        await self._client.load(r, "/update_weight_version", payloads.weight_version_body(version), timeout)
