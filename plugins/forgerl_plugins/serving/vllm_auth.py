"""The key guard of a forgerl vLLM server (the generator's replicas, a served reward
model): every path requires the run's key.

vLLM's own ``--api-key`` check guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``. Our servers run with ``VLLM_SERVER_DEV_MODE=1`` (the weight updates need
``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``), and dev mode's
routes sit outside those prefixes: without this middleware anyone who reaches the port can
call a worker method by name. The launcher adds it with ``--middleware`` (vLLM adds it
last, so it is the outermost layer and sees every request before routing); it reads the
key from ``VLLM_API_KEY`` in the server's environment, the same variable vLLM's own check
reads, so both agree on one key that never appears on a command line. The check itself is
:class:`.require_key.RequireKey`, shared with the SGLang servers' guard.

The module imports nothing outside the standard library: vLLM imports it in its API
server process.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

from forgerl_plugins.serving.require_key import RequireKey, presented_key

__all__ = ["KEY_ENV", "MIDDLEWARE", "RequireRunKey", "presented_key"]

KEY_ENV = "VLLM_API_KEY"
#: The dotted name the launcher passes to ``--middleware``.
MIDDLEWARE = "forgerl_plugins.serving.vllm_auth.RequireRunKey"


class RequireRunKey(RequireKey):
    """:class:`RequireKey` with the key from ``$VLLM_API_KEY`` (vLLM builds it with the app alone)."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str | None = None) -> None:
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            # Fail closed: a server without its key would serve everyone.
            raise RuntimeError(
                f"{MIDDLEWARE} needs the run's key in ${KEY_ENV}; refusing to serve without it"
            )
        super().__init__(app, key)
