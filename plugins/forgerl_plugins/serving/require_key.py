"""ASGI middleware that makes every path of a server require the run's key.

Engines guard only some of their routes with their own key check: vLLM's ``--api-key``
skips its dev-mode admin routes, SGLang's skips ``/health*``, ``/metrics`` and CORS
preflights. forgerl puts this in front of the whole app instead (vLLM: ``--middleware``,
:mod:`.vllm_auth`; SGLang: :mod:`forgerl_plugins.generators.sglang.guard`), so any request without the key is
refused before routing.

``/health`` is guarded too: the only clients of a forgerl server are the launcher and the
generator, which both hold the key, and a health check that needs the key also proves the
server on that port is ours and not whatever took the port after ours died.

The module imports nothing outside the standard library: it is imported inside the
engines' API server processes, and a unit test can drive it with plain ASGI messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def _digest(value: bytes) -> bytes:
    # Compare digests, not the strings: equal lengths, so the comparison time says
    # nothing about the key's length either.
    return hashlib.sha256(value).digest()


def presented_key(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = bytes(value).strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class RequireKey:
    """Refuses every HTTP request (any method, any path, routed or not) and every
    WebSocket whose ``Authorization`` header does not carry ``key``: 401 for HTTP, a
    close before accepting (policy violation) for a WebSocket. Lifespan events pass."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str) -> None:
        if not key:
            # Fail closed: a server without its key would serve everyone.
            raise RuntimeError("a server guard needs the run's key; refusing to serve without it")
        self.app = app
        self._expected = _digest(key.encode())

    def allows(self, scope: Scope) -> bool:
        token = presented_key(scope)
        return token is not None and hmac.compare_digest(_digest(token), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": "Unauthorized: this server needs the run's key"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
