"""The HTTP calls the vllm generator makes to one replica, each with the replica's API key.

Health and admin calls (``/pause``, ``/resume``, ``/reset_prefix_cache``) come from the
shared client (:mod:`..common.client`); here: generation (``/v1/completions``), model
info, and weight loads (``/collective_rpc`` into :mod:`.worker_extension`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forgerl_plugins.generators.common.client import HEALTH_TIMEOUT, HealthClient, error_message
from forgerl_plugins.generators.common.replica import Replica

__all__ = ["ReplicaClient", "error_message"]

if TYPE_CHECKING:  # pragma: no cover
    import httpx

# Margin on top of the transport's timeout for one weight load over HTTP.
LOAD_MARGIN = 60.0


class ReplicaClient(HealthClient):
    """``ReplicaClient(connections, request_timeout)``; create it on the loop that uses it."""

    async def complete(self, r: Replica, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
        """One ``/v1/completions`` request, or one to ``path`` (timed out by the client's
        request timeout)."""
        return await self.http.post(r.url + path, json=body, headers=r.headers)

    async def fetch_model_info(self, r: Replica) -> None:
        resp = await self.http.get(r.url + "/v1/models", headers=r.headers, timeout=HEALTH_TIMEOUT)
        resp.raise_for_status()
        models = resp.json().get("data") or []
        if models:
            r.model = r.model or str(models[0].get("id", ""))
            length = models[0].get("max_model_len")
            r.max_model_len = int(length) if length else None

    async def rpc(
        self, r: Replica, method: str, *args: str, rpc_timeout: float | None = None, timeout: float = 60.0
    ) -> httpx.Response:
        """``POST /collective_rpc``: ``method(*args)`` of the worker extension on every worker
        of ``r`` (``rpc_timeout``: how long vLLM lets the workers take; ``timeout``: ours)."""
        body: dict[str, Any] = {"method": method}
        if args:
            body["args"] = list(args)
        if rpc_timeout is not None:
            body["timeout"] = rpc_timeout
        return await self.http.post(r.url + "/collective_rpc", json=body, headers=r.headers, timeout=timeout)

    async def probe_version(self, r: Replica, adapter: str | None = None) -> None:
        """Ask the workers which weights they hold: 0 for a fresh server (the model folder);
        a server this generator did not start may hold anything. ``adapter``: on a shared
        fleet's server, the version of that adapter (0: they hold none of that name)."""
        if adapter is None:
            resp = await self.rpc(r, "forge_policy_version")
        else:
            resp = await self.rpc(r, "forge_adapter_version", adapter)
        resp.raise_for_status()
        versions = {int(v) for v in resp.json().get("results") or []}
        r.version = versions.pop() if len(versions) == 1 else None
        r.probed = True

    async def zero_adapter(self, r: Replica, config: str) -> list[list[int]]:
        """``forge_zero_adapter(config)`` on every worker of ``r``: the all-zero LoRA
        adapter where none is held; the adapter ids each worker holds."""
        resp = await self.rpc(r, "forge_zero_adapter", config)
        resp.raise_for_status()
        return [list(ids) for ids in resp.json().get("results") or []]

    async def sampled_so_far(self, r: Replica, keys: str) -> dict[str, dict[str, int]]:
        """Tokens sampled so far by our requests ``keys`` (a JSON list) on paused ``r``
        (the first worker's answer: every worker runs the same requests)."""
        resp = await self.rpc(r, "forge_sampled_so_far", keys)
        resp.raise_for_status()
        results = resp.json().get("results") or [{}]
        return dict(results[0] or {})

    async def stage_weights(self, r: Replica, request: str) -> httpx.Response:
        """``forge_stage_weights(request)`` on every worker of ``r``: starts their read of
        a version, or says how it stands; answers at once."""
        return await self.rpc(r, "forge_stage_weights", request)

    async def load_weights(self, r: Replica, request: str, timeout: float) -> httpx.Response:
        """``forge_load_weights(request)`` on every worker of ``r``; ``timeout``: the
        transport's, which the workers wait at most."""
        return await self.rpc(
            r, "forge_load_weights", request, rpc_timeout=timeout + LOAD_MARGIN, timeout=timeout + 2 * LOAD_MARGIN
        )
