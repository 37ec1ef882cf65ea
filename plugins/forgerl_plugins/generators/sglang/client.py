"""The HTTP calls the sglang generator makes to one replica, each with the replica's key.

Health and the shared admin call come from :mod:`..common.client`; here: ``/generate``,
``/model_info`` (which weights it serves; it needs the key, so an answer also proves the
server on that port is ours: SGLang's ``/health`` answers anyone), the weight updates
(``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``), a LoRA adapter's (``/load_lora_adapter``,
``/unload_lora_adapter``), and ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/flush_cache``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError
from forgerl_plugins.generators.common.client import HEALTH_TIMEOUT, HealthClient, error_message
from forgerl_plugins.generators.common.replica import Replica

if TYPE_CHECKING:  # pragma: no cover
    import httpx

# Margin on top of the transport's timeout for one weight load over HTTP.
LOAD_MARGIN = 60.0


class SGLangClient(HealthClient):
    """``SGLangClient(connections, request_timeout)``; create it on the loop that uses it."""

    async def generate(self, r: Replica, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post(r.url + "/generate", json=body, headers=r.headers)

    async def weight_version(self, r: Replica) -> None:
        """Which weights ``r`` serves (``weight_version`` of ``/model_info``): ours are
        numbers; anything else is unknown weights (it is reloaded before it serves)."""
        resp = await self.http.get(r.url + "/model_info", headers=r.headers, timeout=HEALTH_TIMEOUT)
        resp.raise_for_status()
        served = str(resp.json().get("weight_version", ""))
        r.version = int(served) if served.isdigit() else None
        r.probed = True

    async def load(self, r: Replica, path: str, body: dict[str, Any], timeout: float) -> None:
        """One weight-loading call; TransportError when SGLang says it failed."""
        resp = await self.http.post(r.url + path, json=body, headers=r.headers, timeout=timeout + LOAD_MARGIN)
        if resp.status_code != 200:
            raise TransportError(f"replica {r.index}: {path} HTTP {resp.status_code}: {error_message(resp)}")
        answer = resp.json()
        if isinstance(answer, dict) and answer.get("success") is False:
            raise TransportError(f"replica {r.index}: {path}: {answer.get('message')}")

    async def lora(self, r: Replica, path: str, body: dict[str, Any], timeout: float) -> tuple[bool, str]:
        """One adapter call: whether SGLang did it, and what it said when not (its
        ``LoRAUpdateOutput``: ``success``, ``error_message``; HTTP 400 on failure)."""
        resp = await self.http.post(r.url + path, json=body, headers=r.headers, timeout=timeout + LOAD_MARGIN)
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        if resp.status_code == 200 and isinstance(answer, dict) and answer.get("success") is not False:
            return True, ""
        said = answer.get("error_message") if isinstance(answer, dict) else None
        return False, f"HTTP {resp.status_code}: {said or error_message(resp)}"

    async def abort_all(self, r: Replica) -> None:
        await self.admin(r, "/abort_request", json={"abort_all": True})
