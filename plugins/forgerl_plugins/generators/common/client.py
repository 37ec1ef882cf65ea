"""The HTTP client a server generator shares across its replicas, each call with the
replica's API key: one pooled ``httpx.AsyncClient``, used only from the generator's event
loop. The engines' own calls (generation, weight loads) are in their subclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .replica import HEALTH_FAILURES, Replica

if TYPE_CHECKING:  # pragma: no cover
    import httpx

HEALTH_TIMEOUT = 10.0
# Seconds an admin call (pause, resume, cache reset) may take.
ADMIN_TIMEOUT = 30.0


class HealthClient:
    """``HealthClient(connections, request_timeout)``; create it on the loop that uses it."""

    def __init__(self, connections: int, request_timeout: float) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(request_timeout, connect=10.0),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

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

    async def admin(
        self, r: Replica, path: str, params: dict[str, str] | None = None, json: Any = None
    ) -> httpx.Response:
        """An admin call; raises on an HTTP error status. Our own requests are drained or
        aborted before a pause, so these answer at once on a live server; one that does
        not is hung (its launcher replaces it)."""
        resp = await self.http.post(
            r.url + path, params=params, json=json, headers=r.headers, timeout=ADMIN_TIMEOUT
        )
        resp.raise_for_status()
        return resp


def error_message(resp: httpx.Response) -> str:
    """What a server said about a failed request, shortened."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message", data)))
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    return str(data)[:300]
