"""The HTTP calls the vllm generator makes to one replica, each with the replica's API key.

One pooled ``httpx.AsyncClient`` for all replicas, used only from the generator's event
loop. Generation (``/v1/completions``), health, model info, and the admin calls that
pause, resume and load weights (``/pause``, ``/resume``, ``/reset_prefix_cache``,
``/collective_rpc`` into :mod:`.worker_extension`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .replica import HEALTH_FAILURES, Replica

if TYPE_CHECKING:  # pragma: no cover
    import httpx

HEALTH_TIMEOUT = 10.0
# Seconds an admin call (pause, resume, cache reset) may take.
ADMIN_TIMEOUT = 30.0
# Margin on top of the transport's timeout for one weight load over HTTP.
LOAD_MARGIN = 60.0


class ReplicaClient:
    """``ReplicaClient(connections, request_timeout)``; create it on the loop that uses it."""

    def __init__(self, connections: int, request_timeout: float) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(request_timeout, connect=10.0),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def complete(self, r: Replica, body: dict[str, Any]) -> httpx.Response:
        """One ``/v1/completions`` request (timed out by the client's request timeout)."""
        return await self.http.post(r.url + "/v1/completions", json=body, headers=r.headers)

    async def healthy(self, r: Replica) -> bool:
        """One health check; counts failures on ``r`` (a refused connection counts as all)."""
        import httpx

        try:
            resp = await self.http.get(r.url + "/health", headers=r.headers, timeout=HEALTH_TIMEOUT)
        except httpx.ConnectError as exc:
            r.failures = HEALTH_FAILURES  # nothing listens: no point in waiting
            r.last_error = f"health check: {type(exc).__name__}"
            return False
        except httpx.HTTPError as exc:
            r.failures += 1
            r.last_error = f"health check: {type(exc).__name__}"
            return False
        if resp.status_code != 200:
            r.failures += 1
            r.last_error = f"health check: HTTP {resp.status_code}"
            return False
        r.failures = 0
        return True

    async def fetch_model_info(self, r: Replica) -> None:
        resp = await self.http.get(r.url + "/v1/models", headers=r.headers, timeout=HEALTH_TIMEOUT)
        resp.raise_for_status()
        models = resp.json().get("data") or []
        if models:
            r.model = r.model or str(models[0].get("id", ""))
            length = models[0].get("max_model_len")
            r.max_model_len = int(length) if length else None

    async def probe_version(self, r: Replica) -> None:
        """Ask the workers which weights they hold: 0 for a fresh server (the model folder);
        a server this generator did not start may hold anything."""
        resp = await self.http.post(
            r.url + "/collective_rpc",
            json={"method": "forge_policy_version"},
            headers=r.headers,
            timeout=60.0,
        )
        resp.raise_for_status()
        versions = {int(v) for v in resp.json().get("results") or []}
        r.version = versions.pop() if len(versions) == 1 else None
        r.probed = True

    async def admin(self, r: Replica, path: str, params: dict[str, str] | None = None) -> None:
        # Our own requests are drained or aborted before a pause, so these answer at once
        # on a live server; one that does not is hung (its launcher replaces it).
        resp = await self.http.post(r.url + path, params=params, headers=r.headers, timeout=ADMIN_TIMEOUT)
        resp.raise_for_status()

    async def load_weights(self, r: Replica, request: str, timeout: float) -> httpx.Response:
        """``forge_load_weights(request)`` on every worker of ``r``; ``timeout``: the
        transport's, which the workers wait at most."""
        return await self.http.post(
            r.url + "/collective_rpc",
            json={"method": "forge_load_weights", "args": [request], "timeout": timeout + LOAD_MARGIN},
            headers=r.headers,
            timeout=timeout + 2 * LOAD_MARGIN,
        )


def error_message(resp: httpx.Response) -> str:
    """What a server said about a failed request, shortened."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    return str(data)[:300]
