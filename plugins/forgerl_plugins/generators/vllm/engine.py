"""The vllm generator's engine adapter (:class:`~..common.engine.Engine`): how the pool
speaks to one vLLM replica (every HTTP call, with the replica's key: :mod:`.client`).

* **generation**: one ``/v1/completions`` request per prompt (:mod:`.completions`);
* **meeting a replica**: its model info (context length) and the weights its workers hold;
* **weight loads**: ``/pause`` in the update policy's mode (vLLM's own: ``wait``,
  ``abort``, ``keep``), then ``POST /collective_rpc`` into the worker extension
  (:mod:`.worker_extension`), which pulls the version from the run's transport inside
  vLLM's workers; then the prefix cache is reset and the replica resumes. Under ``keep``
  the workers are first asked how many tokens each frozen request has sampled
  (:mod:`..common.crossings`), and the reset also drops the frozen requests' own KV
  (``reset_running_requests``): vLLM recomputes it with the new weights when they go on,
  so every token after the update is sampled by the new weights given its whole prefix,
  as the trainer scores it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError
from forgerl.interfaces import RunContext, Transport
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.crossings import Flight, label
from forgerl_plugins.generators.common.replica import Replica

from .client import ReplicaClient, error_message
from .completions import parse_completions, request_body
from .server import ROLE

if TYPE_CHECKING:  # pragma: no cover
    from .generator import VLLMGenerator


class VLLMEngine:
    """``VLLMEngine(options, *, context, transport)``: the replicas' workers receive new
    weights through ``transport``'s :meth:`~forgerl.interfaces.Transport.receiver_spec`."""

    role = ROLE
    label = "vLLM"
    client: ReplicaClient

    def __init__(self, options: VLLMGenerator.Options, *, context: RunContext, transport: Transport) -> None:
        self.request_timeout = options.request_timeout
        self.send_seed = options.send_seed  # on the CPU build, see server.whole_prefill_args
        self.transport_timeout = context.transport_timeout
        self.transport = transport

    def connect(self, connections: int) -> None:
        self.client = ReplicaClient(connections, self.request_timeout)

    async def introduce(self, r: Replica) -> None:
        if r.max_model_len is None:
            await self.client.fetch_model_info(r)
        if not r.probed:
            await self.client.probe_version(r)

    async def send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        body = request_body(request, r, send_seed=self.send_seed)
        key = body["request_id"] = f"{request.request_id}-{os.urandom(4).hex()}"
        flight = r.flights[key] = Flight(key, version)
        try:
            resp = await self.client.complete(r, body)
        finally:
            r.flights.pop(key, None)
        completions = parse_completions(request, resp, version)
        greedy = request.sampling.temperature <= 0  # every completion a copy of choice 0
        label(completions, flight, choices=[0] * len(completions) if greedy else None)
        return completions

    async def pause(self, r: Replica, policy: str) -> None:
        await self.client.admin(r, "/pause", params={"mode": policy})  # vLLM's modes: wait, abort, keep

    async def sampled_so_far(self, r: Replica, keys: list[str]) -> dict[str, dict[int, int]]:
        if not keys:
            return {}
        found = await self.client.sampled_so_far(r, json.dumps(keys))
        return {key: {int(c): int(n) for c, n in choices.items()} for key, choices in found.items()}

    async def resume(self, r: Replica, policy: str) -> None:
        # Under keep the frozen requests hold blocks computed by the old weights: vLLM
        # then declines a plain reset. Preempting them frees those blocks; each is
        # recomputed (prompt and tokens so far, one prefill) with the new weights.
        params = {"reset_running_requests": "true"} if policy == "keep" else None
        await self.client.admin(r, "/reset_prefix_cache", params=params)
        await self.client.admin(r, "/resume")

    async def load(self, r: Replica, version: int) -> None:
        """Load ``version`` on every worker of ``r`` (the transport's, or the model folder's
        for version 0)."""
        timeout = self.transport_timeout
        request: dict[str, Any] = {
            "version": version,
            "timeout": timeout,
            "worker_prefix": f"vllm-{r.index}-{(r.instance or '')[:8]}",
        }
        if version == 0:
            request["source"] = "base"
        else:
            # The workers build the same transport from its description and connect
            # through the spec.
            request["source"] = "transport"
            request["transport"] = {"described": self.transport.describe(), "spec": self.transport.receiver_spec()}
        resp = await self.client.load_weights(r, json.dumps(request), timeout)
        if resp.status_code != 200:
            r.version = None
            raise TransportError(
                f"replica {r.index}: collective_rpc HTTP {resp.status_code}: {error_message(resp)}"
            )
        results = resp.json().get("results") or []
        r.last_load = results
        failed = [x for x in results if not (isinstance(x, dict) and x.get("ok"))]
        if failed or not results:
            touched = any(isinstance(x, dict) and x.get("weights_touched") for x in failed) or not results
            if touched:
                r.version = None
            what = (
                "; ".join(str(x.get("error") if isinstance(x, dict) else x) for x in failed)
                or "no worker answered"
            )
            raise TransportError(f"replica {r.index} did not load weights version {version}: {what}")

    def close(self) -> None:
        pass  # nothing beside its client
