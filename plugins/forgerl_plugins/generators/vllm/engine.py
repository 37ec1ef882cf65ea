"""The vllm generator's engine adapter (:class:`~..common.engine.Engine`): how the pool
speaks to one vLLM replica (every HTTP call, with the replica's key: :mod:`.client`).

* **generation**: one ``/v1/completions`` request per prompt (:mod:`.completions`);
* **meeting a replica**: its model info (context length) and the weights its workers hold;
* **staging** (option ``stage_updates``, full weights only): before the pause the workers
  read the version from the transport while the replica generates (``forge_stage_weights``
  starts a thread in each worker and is asked again every :data:`STAGE_POLL` s until the
  read is done), so the pause holds the in-place load alone; with ``prepack_updates`` (on
  by default) a CPU server's workers also build the new packed layers before the pause,
  and the load only swaps them in (:mod:`.prepack`);
* **weight loads**: ``/pause`` in the update policy's mode (vLLM's own: ``wait``,
  ``abort``, ``keep``), then ``POST /collective_rpc`` into the worker extension
  (:mod:`.worker_extension`), which pulls the version from the run's transport inside
  vLLM's workers; then the prefix cache is reset and the replica resumes. Under ``keep``
  the workers are first asked how many tokens each frozen request has sampled
  (:mod:`..common.crossings`), and the reset also drops the frozen requests' own KV
  (``reset_running_requests``): vLLM recomputes it with the new weights when they go on,
  so every token after the update is sampled by the new weights given its whole prefix,
  as the trainer scores it.
* **a LoRA adapter** (``context.adapter``): each version holds only the adapter, which
  the workers load in place as the server's one adapter (:mod:`.adapter`). When the
  generator first meets a server, its workers install the all-zero adapter (version 0:
  the base model's outputs exactly) unless they hold one already, and the adapter is
  named to its API server; every request names it as its model. So a request in flight
  at an update (``keep``) goes on with the new adapter, whatever version it began on.
* **a shared fleet** (``fleet``, :mod:`.fleet`): the servers serve other runs' adapters
  too. This run's adapter has a name of its own (:func:`.fleet.adapter_name`); each
  version is first handed to the workers under that name, then registered with the API
  server under a path naming the version (:mod:`.adapter`), which loads it in place as the
  adapter's one id. Version 0 is the base model (requests name it until version 1 is
  registered: the fleet allows only the ``wait`` policy, so no request crosses a
  version). No server is paused (our own requests on it have drained), and no prefix
  cache is reset: vLLM keys cached blocks by the adapter's name and path, and the path is
  new with every version. At the end the run unloads its adapter; the servers are the
  fleet's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from forgerl.adapters import ADAPTER_NAME
from forgerl.errors import TransportError
from forgerl.interfaces import RunContext, Transport
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.crossings import Flight, label
from forgerl_plugins.generators.common.replica import Replica
from forgerl_plugins.models.vision import placeholder_ids_in

from .client import LOAD_MARGIN, ReplicaClient, error_message
from .completions import parse_completions, request_body
from .images import GENERATE_PATH, image_request_body, parse_image_completions
from .server import ROLE

if TYPE_CHECKING:  # pragma: no cover
    from .fleet import FleetInfo
    from .options import Options

log = logging.getLogger(__name__)

#: Seconds between asking the workers whether their staged read is done (each ask is one
#: RPC, run between two engine steps).
STAGE_POLL = 0.02


class VLLMEngine:
    """``VLLMEngine(options, *, context, transport)``: the replicas' workers receive new
    weights through ``transport``'s :meth:`~forgerl.interfaces.Transport.receiver_spec`."""

    role = ROLE
    label = "vLLM"
    client: ReplicaClient

    def __init__(
        self, options: Options, *, context: RunContext, transport: Transport, fleet: FleetInfo | None = None
    ) -> None:
        from . import fleet as _fleet

        self.fleet = fleet
        #: What requests name as their model from version 1 on.
        self.adapter_name = _fleet.adapter_name(context) if fleet is not None else ADAPTER_NAME
        self.request_timeout = options.request_timeout
        self.send_seed = options.send_seed  # on the CPU build, see server.whole_prefill_args
        self.transport_timeout = context.transport_timeout
        self.stage_updates = options.stage_updates
        # A compiled model (enforce_eager off) may have traced the layers' packed handlers
        # into its graphs, where swapping them would not reach: it reloads instead.
        self.prepack_updates = options.prepack_updates and options.enforce_eager
        self.transport = transport
        self.adapter = context.adapter
        # The adapter's adapter_config.json (the workers need its rank and alpha, not the
        # matched module names: the tensors' names say which modules).
        self.adapter_config = (
            context.adapter.peft_config(context.adapter.target_modules) if context.adapter is not None else None
        )
        self._named: set[tuple[int, str | None]] = set()  # (replica, instance): servers told the adapter's name
        #: A VLM's image placeholder ids, which end a sequence when sampled (docs/vision.md).
        self.placeholders = placeholder_ids_in(context.model_path) if context.model_path is not None else frozenset()

    def connect(self, connections: int) -> None:
        self.client = ReplicaClient(connections, self.request_timeout)

    async def introduce(self, r: Replica) -> None:
        if r.max_model_len is None:
            await self.client.fetch_model_info(r)
        if not r.probed:
            # On a fleet's server: the version of this run's adapter there (0: none).
            await self.client.probe_version(r, self.adapter_name if self.fleet is not None else None)
        if self.adapter is not None and self.fleet is None and (r.index, r.instance) not in self._named:
            await self._name_adapter(r)

    async def send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        images = request.images is not None
        if images:
            body = image_request_body(request, r, send_seed=self.send_seed, placeholders=self.placeholders)
        else:
            body = request_body(request, r, send_seed=self.send_seed)
        if self.adapter is not None and (self.fleet is None or version > 0):
            # The base model with the adapter of ``version`` (alone on the server: 0 is the
            # all-zero adapter; on a fleet, version 0 is the base model itself).
            body["model"] = self.adapter_name
        key = body["request_id"] = f"{request.request_id}-{os.urandom(4).hex()}"
        flight = r.flights[key] = Flight(key, version)
        try:
            resp = await self.client.complete(r, body, GENERATE_PATH) if images else await self.client.complete(r, body)
        finally:
            r.flights.pop(key, None)
        if images:
            completions = parse_image_completions(request, resp, version)
        else:
            completions = parse_completions(request, resp, version)
        greedy = request.sampling.temperature <= 0  # every completion a copy of choice 0
        label(completions, flight, choices=[0] * len(completions) if greedy else None)
        return completions

    async def pause(self, r: Replica, policy: str) -> None:
        if self.fleet is not None:
            # Other runs' requests go on: only ours must not run across the load. Under
            # wait they have drained; a re-sync (abort) resubmits them, once they are back.
            await r.idle.wait()
            return
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
        if self.fleet is not None:
            return  # never paused; its cache keys name each adapter version (see the module)
        params = {"reset_running_requests": "true"} if policy == "keep" else None
        await self.client.admin(r, "/reset_prefix_cache", params=params)
        await self.client.admin(r, "/resume")

    async def stage(self, r: Replica, version: int) -> None:
        """Have ``r``'s workers read ``version`` from the transport while ``r`` generates;
        returns when every worker has it, or (logged) when a worker could not stage it:
        the load then reads it itself and reports what failed."""
        if not self.stage_updates or version == 0 or self.adapter is not None:
            return
        request = json.dumps(self._load_request(r, version))
        deadline = time.monotonic() + self.transport_timeout + LOAD_MARGIN
        while True:
            resp = await self.client.stage_weights(r, request)
            results = resp.json().get("results") if resp.status_code == 200 else None
            if not results or not all(isinstance(x, dict) and x.get("ok") for x in results):
                what = error_message(resp) if resp.status_code != 200 else results
                log.warning("vllm: replica %d could not stage weights version %d (%s): loading it under the pause",
                            r.index, version, what)  # fmt: skip
                return
            if all(x.get("done") for x in results) or time.monotonic() > deadline:
                return
            await asyncio.sleep(STAGE_POLL)

    async def load(self, r: Replica, version: int) -> None:
        """Load ``version`` on every worker of ``r`` (the transport's, or the model folder's
        for version 0; staged by :meth:`stage`: from the workers' memory)."""
        timeout = self.transport_timeout
        resp = await self.client.load_weights(r, json.dumps(self._load_request(r, version)), timeout)
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
        if self.fleet is not None:
            await self._register_version(r, version)

    def _load_request(self, r: Replica, version: int) -> dict[str, Any]:
        """What the workers are asked to load (and to stage): the JSON of
        :meth:`.worker_extension.ForgeWorkerExtension.forge_load_weights`."""
        request: dict[str, Any] = {
            "version": version,
            "timeout": self.transport_timeout,
            "worker_prefix": f"vllm-{r.index}-{(r.instance or '')[:8]}",
        }
        if self.adapter_config is not None:
            request["adapter"] = self.adapter_config
        if self.fleet is not None:
            request["adapter_name"] = self.adapter_name
            request["worker_prefix"] += f"-{self.adapter_name[-10:]}"  # the run's receivers, beside others'
        if version == 0:
            request["source"] = "base"
        else:
            # The workers build the same transport from its description and connect
            # through the spec.
            request["source"] = "transport"
            if self.stage_updates and self.prepack_updates:
                request["prepack"] = True  # read by the stage (worker_extension.forge_stage_weights)
            request["transport"] = {"described": self.transport.describe(), "spec": self.transport.receiver_spec()}
        return request

    async def _name_adapter(self, r: Replica) -> None:
        """Once per server: have its workers hold an adapter (the all-zero one on a fresh
        server), then tell its API server the adapter's name (:mod:`.adapter`)."""
        from . import adapter

        held = await self.client.zero_adapter(r, json.dumps(self.adapter_config))
        if any(ids != [adapter.ADAPTER_ID] for ids in held):
            raise TransportError(f"replica {r.index}: its workers hold LoRA adapters {held}, not [{adapter.ADAPTER_ID}]")
        resp = await self.client.http.post(
            r.url + "/v1/load_lora_adapter", json=adapter.register_body(), headers=r.headers, timeout=60.0
        )
        if resp.status_code != 200 and "already been loaded" not in resp.text:
            r.version = None
            raise TransportError(
                f"replica {r.index}: naming the LoRA adapter failed: HTTP {resp.status_code}: {error_message(resp)}"
            )
        self._named.add((r.index, r.instance))

    async def _register_version(self, r: Replica, version: int) -> None:
        """On a fleet's server: make the API server serve ``version`` of this run's adapter
        (its workers hold it, :meth:`load`), or none for version 0."""
        from . import adapter

        if version == 0:
            resp = await self.client.http.post(
                r.url + "/v1/unload_lora_adapter", json={"lora_name": self.adapter_name}, headers=r.headers,
                timeout=60.0,
            )  # fmt: skip
            if resp.status_code not in (200, 404):  # 404: it was not registered
                r.version = None
                raise TransportError(f"replica {r.index}: unloading LoRA adapter {self.adapter_name} failed: "
                                     f"HTTP {resp.status_code}: {error_message(resp)}")  # fmt: skip
            return
        resp = await self.client.http.post(
            r.url + "/v1/load_lora_adapter", json=adapter.named_register_body(self.adapter_name, version),
            headers=r.headers, timeout=self.transport_timeout + LOAD_MARGIN,
        )  # fmt: skip
        if resp.status_code != 200:
            r.version = None
            raise TransportError(f"replica {r.index}: loading LoRA adapter {self.adapter_name} version {version} "
                                 f"failed: HTTP {resp.status_code}: {error_message(resp)}")  # fmt: skip

    async def release(self, replicas: list[Replica]) -> None:
        """At the run's end, on a fleet's servers: unload this run's adapter (from the API
        server, and its tensors and receivers from the workers). The servers go on."""
        if self.fleet is None:
            return
        for r in replicas:
            if not r.up:
                continue
            try:
                await self.client.http.post(
                    r.url + "/v1/unload_lora_adapter", json={"lora_name": self.adapter_name}, headers=r.headers,
                    timeout=60.0,
                )  # fmt: skip
                await self.client.rpc(r, "forge_drop_adapter", self.adapter_name)
            except Exception as exc:  # noqa: BLE001 - the run ends either way; the fleet's LRU evicts it later
                log.warning("vllm: could not unload adapter %s from fleet replica %d: %s",
                            self.adapter_name, r.index, exc)  # fmt: skip

    def close(self) -> None:
        pass  # nothing beside its client
