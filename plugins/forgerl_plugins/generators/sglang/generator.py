"""The ``sglang`` generator: SGLang servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`SGLangGenerator`, a pool of replicas shared with the other
server generators (:mod:`..common.pool`: dispatch to the least busy ready replica,
failover to the others, the watcher that re-syncs a restarted replica before it takes
traffic). What is SGLang's own:

* **generation**: one native ``/generate`` per sample (:mod:`.payloads`), every HTTP call
  with the replica's key (:mod:`.client`); each answer's ``meta_info.weight_version`` is
  checked against the version the sample was dispatched under;
* **weight loads** (:mod:`.weights`) through an engine receiver of the run's transport
  (``files`` → ``/update_weights_from_disk``, ``broadcast`` →
  ``/update_weights_from_distributed``), paused by the update policy;
* **meeting a replica**: the weights it serves (``/model_info``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.errors import UserError
from forgerl.interfaces import EngineReceiver, RunContext, Transport
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.pool import ReplicaPool
from forgerl_plugins.generators.common.replica import Replica

from .client import SGLangClient
from .payloads import generate_body, parse_generate
from .server import endpoint_file, log_file
from .weights import SGLangWeightUpdates

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.generators.sglang.options import SGLangGeneratorOptions

#: Preferred first when the transport offers both.
SYNC_KINDS = ("broadcast", "files")


def choose_weight_sync(wanted: str, transport: Transport) -> str:
    """``files`` or ``broadcast``: what the options ask for and the transport offers."""
    offered = tuple(getattr(transport, "engine_receivers", ()))
    name = type(transport).__name__
    if wanted == "auto":
        for kind in SYNC_KINDS:
            if kind in offered:
                return kind
        raise UserError(
            f"the sglang generator needs a transport SGLang can load from (shm or nccl); {name} offers "
            "neither files nor broadcast"
        )
    if wanted not in offered:
        raise UserError(
            f"generator.options.weight_sync is {wanted!r}, but the run's transport ({name}) offers "
            f"{list(offered) or 'nothing an engine can load'}: use shm for files, nccl for broadcast"
        )
    return wanted


class SGLangGenerator(SGLangWeightUpdates, ReplicaPool):
    """``SGLangGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir`` and loads new weights into them through ``transport``'s engine
    receivers."""

    engine = "sglang"
    label = "SGLang"
    options: SGLangGeneratorOptions
    _client: SGLangClient

    def __init__(self, options: SGLangGeneratorOptions, *, context: RunContext, transport: Transport) -> None:
        self.weight_sync = choose_weight_sync(options.weight_sync, transport)
        self._receivers: dict[str, EngineReceiver] = {}
        self._joined: set[int] = set()
        super().__init__(options, context=context, transport=transport)

    def _endpoint_file(self, index: int) -> Path:
        return endpoint_file(self.run_dir, index)

    def _log_file(self, index: int) -> Path:
        return log_file(self.run_dir, index)

    def _make_client(self, connections: int) -> SGLangClient:
        return SGLangClient(connections, self.options.request_timeout)

    async def _introduce(self, r: Replica) -> None:
        if not r.probed:
            await self._client.weight_version(r)
            # A generator closed in the middle of an update (or one that died) may have
            # left the server paused: it would queue our requests for ever. Resuming a
            # server that is not paused does nothing.
            await self._client.admin(r, "/continue_generation", json={})

    async def _send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        async def one(i: int) -> Completion:
            body = generate_body(
                request,
                i,
                f"{request.request_id}-{i}-{os.urandom(4).hex()}",
                send_seed=self.options.send_seed,
            )
            return parse_generate(request, await self._client.generate(r, body), version)

        if request.sampling.temperature <= 0:
            return [await one(0)] * request.n  # greedy: every sample is the same
        return list(await asyncio.gather(*(one(i) for i in range(request.n))))

    def close(self) -> None:
        super().close()
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver.close()
