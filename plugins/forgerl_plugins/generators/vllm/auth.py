"""ASGI middleware that makes every path of a forgerl vLLM server require the run's key.

vLLM's own ``--api-key`` check guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``. Our servers run with ``VLLM_SERVER_DEV_MODE=1`` (the weight updates need
``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``), and dev mode's
routes sit outside those prefixes: without this middleware anyone who reaches the port can
call a worker method by name. The launcher adds it with ``--middleware`` (vLLM adds it
last, so it is the outermost layer and sees every request before routing); it reads the
key from ``VLLM_API_KEY`` in the server's environment, the same variable vLLM's own check
reads, so both agree on one key that never appears on a command line.

``/health`` is guarded too: the only clients of a forgerl server are the launcher and the
generator, which both hold the key, and a health check that needs the key also proves the
server on that port is ours and not whatever took the port after ours died.

The module imports nothing outside the standard library: vLLM imports it in its API
server process, and a unit test can drive it with plain ASGI messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_ENV = "VLLM_API_KEY"
#: The dotted name the launcher passes to ``--middleware``.
MIDDLEWARE = "forgerl_plugins.generators.vllm.auth.RequireRunKey"

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


class RequireRunKey:
    """Refuses every HTTP request (any method, any path, routed or not) and every
    WebSocket whose ``Authorization`` header does not carry the key: 401 for HTTP, a
    close before accepting (policy violation) for a WebSocket. Lifespan events pass."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str | None = None) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            # Fail closed: a server without its key would serve everyone.
            raise RuntimeError(
                f"{MIDDLEWARE} needs the run's key in ${KEY_ENV}; refusing to serve without it"
            )
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
