"""The sglang generator's engine adapter (:class:`~..common.engine.Engine`): how the pool
speaks to one SGLang replica (every HTTP call with the replica's key: :mod:`.client`).

Generation: one native ``/generate`` per sample (:mod:`.payloads`). Weight loads: paused
(``/pause_generation`` in the update policy's mode: ``in_place`` after our requests
drained, ``abort``, or ``retract`` for ``keep``), the version loaded, the cache flushed
(``/flush_cache``), resumed (``/continue_generation``). SGLang receives the bytes itself,
so the run's transport gives an engine receiver per replica instance
(:class:`~forgerl.interfaces.EngineReceiver`):

* ``files`` (shm): the version staged alone in a folder → ``/update_weights_from_disk``;
* ``broadcast`` (nccl): the replica's workers join a group of their own with the trainer
  (``/init_weights_update_group``, once per server instance), then each bucket's names,
  dtypes and shapes go to ``/update_weights_from_distributed`` while the transport
  broadcasts its tensors, inside a weight-update session (``/begin_weight_update`` ...
  ``/end_weight_update``, which SGLang 0.5.23 requires of distributed loads).

Every load names the version (``weight_version``). SGLang's scheduler then notes, for each
request it holds, how many tokens it had sampled, and each answer's ``meta_info`` says
which version sampled which tokens (``weight_versions``): a completion is checked against
the version it was dispatched under and those loaded while it ran (update policy ``keep``:
retracted at the pause, prefilled again with the new weights after the resume, labelled
per token from SGLang's spans). Version 0 (a replica left behind by a failed load) is
reloaded from the model folder.

With a LoRA trainer (``context.adapter``) a version is the adapter alone, loaded from the
folder the ``files`` receiver stages (:mod:`.adapter`): the last version unloaded, this one
loaded under the run's adapter name, which every request names from version 1 on; version
0 is the base model (the adapter unloaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING

from forgerl.adapters import ADAPTER_NAME
from forgerl.errors import TransportError
from forgerl.interfaces import EngineReceiver, RunContext, Transport
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.crossings import Flight
from forgerl_plugins.generators.common.replica import Replica

from . import adapter, payloads
from .client import SGLangClient
from .payloads import generate_body, parse_generate
from .server import ROLE

if TYPE_CHECKING:  # pragma: no cover
    from .options import Options


class SGLangEngine:
    """``SGLangEngine(options, weight_sync, *, context, transport)``: loads new weights
    into the replicas through ``transport``'s engine receivers of kind ``weight_sync``
    (``files`` or ``broadcast``)."""

    role = ROLE
    label = "SGLang"
    client: SGLangClient

    def __init__(
        self, options: Options, weight_sync: str, *, context: RunContext, transport: Transport
    ) -> None:
        self.request_timeout = options.request_timeout
        self.send_seed = options.send_seed
        self.ranks = options.tensor_parallel_size
        self.weight_sync = weight_sync
        self.model_path = str(context.model_path)
        self.transport_timeout = context.transport_timeout
        self.transport = transport
        self.adapter = context.adapter
        self._receivers: dict[str, EngineReceiver] = {}  # by "<replica>:<instance>"
        self._joined: set[int] = set()  # broadcast receivers whose engine joined their group

    def connect(self, connections: int) -> None:
        self.client = SGLangClient(connections, self.request_timeout)

    async def introduce(self, r: Replica) -> None:
        if not r.probed:
            await self.client.weight_version(r)
            # A generator closed in the middle of an update (or one that died) may have
            # left the server paused: it would queue our requests for ever. Resuming a
            # server that is not paused does nothing.
            await self.client.admin(r, "/continue_generation", json={})

    async def send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        lora = ADAPTER_NAME if self.adapter is not None and version > 0 else None

        async def one(i: int) -> Completion:
            rid = f"{request.request_id}-{i}-{os.urandom(4).hex()}"
            body = generate_body(request, i, rid, send_seed=self.send_seed, lora=lora)
            flight = r.flights[rid] = Flight(rid, version)  # the updates it runs across (keep)
            try:
                resp = await self.client.generate(r, body)
            finally:
                r.flights.pop(rid, None)
            return parse_generate(request, resp, version, crossed=[c.version for c in flight.crossings])

        if request.sampling.temperature <= 0:
            return [await one(0)] * request.n  # greedy: every sample is the same
        return list(await asyncio.gather(*(one(i) for i in range(request.n))))

    async def pause(self, r: Replica, policy: str) -> None:
        await self.client.admin(r, "/pause_generation", json=payloads.pause_body(policy))

    async def stage(self, r: Replica, version: int) -> None:
        pass  # SGLang's update endpoint reads the version itself, under the pause

    async def sampled_so_far(self, r: Replica, keys: list[str]) -> dict[str, dict[int, int]]:
        # SGLang counts itself: at the version change its scheduler notes each request's
        # tokens so far, and the answer carries the spans (payloads.token_versions).
        return {}

    async def resume(self, r: Replica, policy: str) -> None:
        # Under keep the replica is paused by retract: what it held is back in its waiting
        # queue with no KV, and SGLang flushes while paused so; each request is prefilled
        # again with the new weights, and no prefix computed by the old ones stays cached.
        await self.client.admin(r, "/flush_cache")
        await self.client.admin(r, "/continue_generation", json={})

    def close(self) -> None:
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver.close()

    async def load(self, r: Replica, version: int) -> None:
        timeout = self.transport_timeout
        try:
            if self.adapter is not None:
                await self._load_adapter(r, version, timeout)
            elif version == 0:
                body = payloads.update_from_disk_body(self.model_path, 0)
                await self.client.load(r, "/update_weights_from_disk", body, timeout)
            elif self.weight_sync == "files":
                await self._load_files(r, version, timeout)
            else:
                await self._load_broadcast(r, version, timeout)
        except TransportError:
            r.version = None  # SGLang may have loaded part of it: reload before serving
            raise

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
                ranks=self.ranks,
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
            await self.client.load(
                r, "/update_weights_from_disk", payloads.update_from_disk_body(str(folder), version), timeout
            )
        finally:
            receiver.release(version)

    async def _load_adapter(self, r: Replica, version: int, timeout: float) -> None:
        """Version ``version`` of the adapter in place of the last (0: none); the base
        weights stay as they are."""
        from forgerl.interfaces import FilesEngineReceiver

        assert self.adapter is not None
        if version > 0:
            receiver = self._receiver(r)
            assert isinstance(receiver, FilesEngineReceiver)
            folder = await asyncio.to_thread(receiver.stage, version, timeout)
            try:
                await asyncio.to_thread(adapter.write_config, folder, self.adapter)
                await self._unload_adapter(r, timeout)
                ok, said = await self.client.lora(r, "/load_lora_adapter", adapter.load_body(folder), timeout)
                if not ok:
                    raise TransportError(f"replica {r.index}: loading LoRA adapter version {version}: {said}")
            finally:
                receiver.release(version)  # SGLang holds the adapter in memory once loaded
        else:
            await self._unload_adapter(r, timeout)
        await self.client.load(r, "/update_weight_version", payloads.weight_version_body(version), timeout)

    async def _unload_adapter(self, r: Replica, timeout: float) -> None:
        """Drop the adapter ``r`` serves, if any (a server met for the first time may hold
        one from an earlier generator, or none)."""
        ok, said = await self.client.lora(r, "/unload_lora_adapter", adapter.unload_body(), timeout)
        if not ok and adapter.NOT_LOADED not in said:
            raise TransportError(f"replica {r.index}: unloading the LoRA adapter: {said}")

    async def _load_broadcast(self, r: Replica, version: int, timeout: float) -> None:
        from forgerl.interfaces import BroadcastEngineReceiver

        receiver = self._receiver(r)
        assert isinstance(receiver, BroadcastEngineReceiver)
        group = receiver.group()
        if id(receiver) not in self._joined:
            # Both sides block until the other has joined: the trainer's side in a thread.
            joining = asyncio.ensure_future(asyncio.to_thread(receiver.connect, timeout))
            try:
                await self.client.load(
                    r, "/init_weights_update_group", payloads.init_group_body(group), timeout
                )
            finally:
                await joining
            self._joined.add(id(receiver))
        it = iter(await asyncio.to_thread(receiver.receive, version, timeout))
        try:
            await self.client.load(r, "/begin_weight_update", payloads.begin_update_body(), timeout)
            bucket = await asyncio.to_thread(next, it, None)
            while bucket is not None:
                # The transport broadcasts the bucket meanwhile; asking for the next one
                # waits for (and raises what went wrong with) this one's broadcast.
                body = payloads.update_distributed_body(bucket, group["group_name"])
                await self.client.load(r, "/update_weights_from_distributed", body, timeout)
                bucket = await asyncio.to_thread(next, it, None)
        except BaseException:
            close = getattr(it, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
            self._drop_receiver(r)
            # A session left open refuses the next load's begin: close it where the server answers.
            with contextlib.suppress(Exception):
                await self.client.load(r, "/end_weight_update", payloads.end_update_body(), timeout)
            raise
        await self.client.load(r, "/end_weight_update", payloads.end_update_body(), timeout)
        # Named only once every bucket is in: a replica that failed half-way still reports
        # the old name (and is reloaded before it serves again).
        await self.client.load(r, "/update_weight_version", payloads.weight_version_body(version), timeout)
