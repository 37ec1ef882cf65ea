"""The ``openai`` generator: completions from an OpenAI-compatible server over HTTP.

The server (vLLM, SGLang, a hosted endpoint) is started and owned by the user; this
generator only talks to it. It cannot load new weights into it, so it declares
``receives_weights = False``: the loop never calls :meth:`update_weights`, says once at
the start of a run that every rollout comes from the initial weights (training is
off-policy), and trains on all of its samples. Every completion reports version 0.

All HTTP runs on one event loop in a thread of this object (forgerl's
:class:`~forgerl.loop_thread.LoopThread`): ``generate`` may be awaited from any event loop
(the rollout thread's, ``asyncio.run`` in evaluation) and shares one connection pool,
bounded by ``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from forgerl.errors import ConfigError, GeneratorError, GeneratorUnreachable
from forgerl.interfaces import Generator, RunContext, Transport
from forgerl.loop_thread import LoopThread
from forgerl.types import Completion, GenerationRequest

from .completions import parse_completions, request_body

if TYPE_CHECKING:  # pragma: no cover
    import httpx

log = logging.getLogger(__name__)

#: The only weights it serves: the server's, which the run counts as its initial version.
SERVED_VERSION = 0
CONNECT_TIMEOUT = 10.0
DEFAULT_KEY_ENV = "OPENAI_API_KEY"


class OpenAICompatGenerator(Generator):
    """``OpenAICompatGenerator(options, *, context, transport)``; ``transport`` is unused."""

    name = "openai"
    description = "any OpenAI-compatible /v1/completions server with token logprobs (fixed weights)"
    requires = ("httpx",)  # imported only inside the methods that talk to the server
    install_hint = "pip install httpx"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        base_url: str = Field(
            description="The server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (requests go to "
            "<base_url>/completions).",
            pattern=r"^https?://",
        )
        api_key_env: str = Field(
            DEFAULT_KEY_ENV,
            description="Name of the environment variable holding the API key (sent as a bearer token). "
            f"Unset {DEFAULT_KEY_ENV}: no key is sent; any other name must be set.",
        )
        model: str | None = Field(
            None, description="Model name the server serves (default: the first one its /models lists)."
        )
        request_timeout: float = Field(
            600.0, gt=0, le=7 * 24 * 3600, description="Seconds one request may take."
        )
        max_concurrency: int = Field(32, ge=1, le=4096, description="Requests in flight at once.")
        max_retries: int = Field(
            2, ge=0, le=100, description="Times a request is sent again after a connection error or a 5xx answer."
        )
        send_seed: bool = Field(
            True, description="Send each request's sampling seed (the server decides whether sampling repeats)."
        )
        extra_body: dict[str, Any] = Field(
            default_factory=dict, description="More fields for every request body (server-specific parameters)."
        )

    receives_weights: ClassVar[bool] = False

    def __init__(self, options: Options, *, context: RunContext, transport: Transport) -> None:
        self.options = options
        self.url = options.base_url.rstrip("/")
        key = os.environ.get(options.api_key_env) or None
        if key is None and options.api_key_env != DEFAULT_KEY_ENV:
            raise ConfigError(
                f"generator.options.api_key_env names {options.api_key_env}, which is not set in the environment"
            )
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        if logging.getLogger("httpx").level == logging.NOTSET:  # one INFO line per request otherwise
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self._closed = False
        self._client: httpx.AsyncClient | None = None
        self._io = LoopThread("forge-openai-http")
        try:
            self.model = self._io.call(self._start(), timeout=CONNECT_TIMEOUT + options.request_timeout)
        except BaseException:
            self.close()
            raise
        log.info("openai generator: model %r at %s", self.model, self.url)

    async def _start(self) -> str:
        import httpx

        n = self.options.max_concurrency
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            timeout=httpx.Timeout(self.options.request_timeout, connect=CONNECT_TIMEOUT),
        )
        self._sem = asyncio.Semaphore(n)
        try:
            resp = await self._client.get(
                self.url + "/models", headers=self._headers, timeout=CONNECT_TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise GeneratorUnreachable(
                f"the OpenAI-compatible server at {self.url} does not answer ({type(exc).__name__}: {exc}); "
                "start it first, or fix generator.options.base_url"
            ) from None
        if resp.status_code in (401, 403):
            raise GeneratorUnreachable(
                f"the server at {self.url} refused the API key (HTTP {resp.status_code}); "
                f"set it in ${self.options.api_key_env}"
            )
        listed = (
            [str(m.get("id")) for m in (resp.json().get("data") or [])] if resp.status_code == 200 else []
        )
        if self.options.model is not None:
            return self.options.model
        if not listed:
            raise ConfigError(
                f"the server at {self.url} lists no model (GET /models: HTTP {resp.status_code}): "
                "set generator.options.model"
            )
        return listed[0]

    @property
    def policy_version(self) -> int:
        return SERVED_VERSION

    # ---------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        if self._closed:
            raise GeneratorError("the openai generator is closed")
        return await self._io.map(self._one, requests)

    async def _one(self, request: GenerationRequest) -> list[Completion]:
        import httpx

        assert self._client is not None
        body = request_body(
            request, self.model, send_seed=self.options.send_seed, extra=self.options.extra_body
        )
        failures: list[str] = []
        async with self._sem:
            while True:
                try:
                    resp = await self._client.post(
                        self.url + "/completions", json=body, headers=self._headers
                    )
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}".strip())
                else:
                    if resp.status_code == 200:
                        return parse_completions(request, resp.json(), SERVED_VERSION)
                    if resp.status_code < 500:  # the request itself is at fault: no retry
                        raise GeneratorError(
                            f"the server refused request {request.request_id!r} (HTTP {resp.status_code}): "
                            f"{_message(resp)}"
                        )
                    failures.append(f"HTTP {resp.status_code}: {_message(resp)}")
                if len(failures) > self.options.max_retries:
                    raise GeneratorUnreachable(
                        f"request {request.request_id!r} failed {len(failures)} time(s) at {self.url}: {failures[-1]}"
                    )
                log.warning("openai: request %s failed (%s); retrying", request.request_id, failures[-1])
                await asyncio.sleep(min(0.5 * 2 ** len(failures), 10.0))  # back off before the retry

    def update_weights(self, version: int) -> None:
        raise GeneratorError(
            "the openai generator serves the server's fixed weights (receives_weights is False): "
            "the loop never calls update_weights"
        )

    def close(self) -> None:
        """Close the connection pool and stop the HTTP thread (the server is the user's)."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        self._io.close(client.aclose() if client is not None else None, timeout=CONNECT_TIMEOUT)


def _message(resp: httpx.Response) -> str:
    """What the server said about a failed request, shortened."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:300]
