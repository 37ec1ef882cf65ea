"""The ``vllm`` generator: vLLM OpenAI servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`VLLMGenerator`, a pool of replicas shared with the other
server generators (:mod:`..common.pool`: dispatch, failover, the watcher, which replicas
load a version). What is vLLM's own:

* **generation**: one ``/v1/completions`` request per prompt (``n`` completions, prompt
  as token ids, ``logprobs: 0`` and ``return_token_ids``; the body and the answer:
  :mod:`.completions`; every HTTP call, with the replica's key: :mod:`.client`);
* **weight loads** (:mod:`.weights`) through ``POST /collective_rpc`` into the worker
  extension (:mod:`.worker_extension`), which pulls the version from the run's transport
  inside vLLM's workers; ``wait`` drains the replica's requests first, ``abort`` aborts
  them and resubmits them once the new weights are in;
* **meeting a replica**: its model info (context length) and the weights its workers hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.interfaces import RunContext, Transport
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.pool import ReplicaPool
from forgerl_plugins.generators.common.replica import Replica

from .client import ReplicaClient
from .completions import parse_completions, request_body
from .server import endpoint_file, log_file
from .weights import VLLMWeightUpdates

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.generators.vllm.options import VLLMGeneratorOptions


class VLLMGenerator(VLLMWeightUpdates, ReplicaPool):
    """``VLLMGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir``; their workers receive new weights through ``transport``'s
    :meth:`~forgerl.interfaces.Transport.receiver_spec`."""

    engine = "vllm"
    label = "vLLM"
    options: VLLMGeneratorOptions
    _client: ReplicaClient

    def __init__(self, options: VLLMGeneratorOptions, *, context: RunContext, transport: Transport) -> None:
        self.send_seed = options.send_seed  # on the CPU build, see server.whole_prefill_args
        super().__init__(options, context=context, transport=transport)

    def _endpoint_file(self, index: int) -> Path:
        return endpoint_file(self.run_dir, index)

    def _log_file(self, index: int) -> Path:
        return log_file(self.run_dir, index)

    def _make_client(self, connections: int) -> ReplicaClient:
        return ReplicaClient(connections, self.options.request_timeout)

    async def _introduce(self, r: Replica) -> None:
        if r.max_model_len is None:
            await self._client.fetch_model_info(r)
        if not r.probed:
            await self._client.probe_version(r)

    async def _send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        body = request_body(request, r, send_seed=self.send_seed)
        body["request_id"] = f"{request.request_id}-{os.urandom(4).hex()}"
        resp = await self._client.complete(r, body)
        return parse_completions(request, resp, version)
