"""How one vllm replica loads a weight version: paused by the update policy, then
``POST /collective_rpc`` into the worker extension (:mod:`.worker_extension`), which pulls
the version from the run's transport inside vLLM's workers; then the prefix cache is reset
and the replica resumes. Which replicas load a version and what failures mean is shared
with the other server generators (:mod:`..common.updates`).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError
from forgerl_plugins.generators.common.replica import Replica
from forgerl_plugins.generators.common.updates import WeightUpdates

from .client import ReplicaClient, error_message

if TYPE_CHECKING:  # pragma: no cover
    from .generator import VLLMGenerator

log = logging.getLogger(__name__)


class VLLMWeightUpdates(WeightUpdates):
    """The vllm generator's ``_update_replica`` (see the module docstring)."""

    options: VLLMGenerator.Options
    _client: ReplicaClient

    async def _update_replica(self, r: Replica, version: int, policy: str | None = None) -> None:
        """Pause ``r`` by ``policy`` (default: the configured one), load ``version``, reset
        its prefix cache and resume it. The caller has set ``r.updating``."""
        import httpx

        policy = policy or self.options.update_policy
        paused = False
        notice = self._pause_notice(r)  # its launcher must not take the pause for a hang
        try:
            if policy == "abort":
                # Before the pause: every request in flight now may be aborted, or queued
                # and run on the new weights; the generator resubmits all of them.
                r.aborts += 1
                await notice.start()
                await self._client.admin(r, "/pause", params={"mode": "abort"})
            else:
                await r.idle.wait()  # our requests on it finish with the weights they started with
                await notice.start()
                await self._client.admin(r, "/pause", params={"mode": "wait"})
            paused = True
            await self._load(r, version)
        except httpx.HTTPError as exc:
            # It stopped answering mid-update: what it holds is unknown.
            r.version = None
            r.take_out(f"weight update: {type(exc).__name__}: {exc}")
            raise
        finally:
            try:
                if paused and r.up:
                    await self._client.admin(r, "/reset_prefix_cache")
                    await self._client.admin(r, "/resume")
            except httpx.HTTPError as exc:
                r.take_out(f"resume after update: {type(exc).__name__}")
            await notice.stop()
            r.updating = False

    async def _load(self, r: Replica, version: int) -> None:
        """Load ``version`` on every worker of ``r`` (the transport's, or the model folder's
        for version 0). Sets ``r.version``; raises TransportError on failure."""
        timeout = self.ctx.transport_timeout
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
        resp = await self._client.load_weights(r, json.dumps(request), timeout)
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
        r.version = version
        log.debug("vllm: replica %d loaded version %d: %s", r.index, version, results)
