"""The run's OpenAI-compatible endpoint for black-box agents (docs/environments.md).

One server per run, on 127.0.0.1, on an event loop of its own (a :class:`LoopThread`):
rollouts and evaluation make episodes from different threads and event loops, and the
agents' HTTP calls must be answered whichever of them is running. Each episode has its
own base URL, ``http://127.0.0.1:PORT/episodes/<episode>/v1``, so that the calls of one
episode form its trajectory; ``<episode>`` is a random token, and every request must carry
the run's key (``Authorization: Bearer <key>``, what OpenAI clients send for ``api_key``).

Routes under an episode's base URL: ``POST /chat/completions`` (:mod:`forgerl.rollouts.agent_episode`),
``GET /models`` and ``GET /models/<id>``. A wrong or missing key is a 401 (before anything
else is looked at), an unknown episode a 404, a finished one a 410; every error is in
OpenAI's format with ``x-should-retry: false``, so that OpenAI clients do not retry what
cannot succeed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from forgerl.errors import ConfigError
from forgerl.loop_thread import LoopThread
from forgerl.rollouts.agent_chat import ApiError, parse_request
from forgerl.rollouts.agent_episode import EpisodeRecorder
from forgerl.rollouts.agent_http import HttpServer, Request, Response

log = logging.getLogger("forgerl.rollouts.agent_endpoint")

_EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_-]{1,64})/v1(/.*)?$")
#: Finished episodes remembered, to answer their late calls with 410 rather than 404.
_REMEMBERED = 4096
_NO_RETRY = [("x-should-retry", "false")]


def error_response(err: ApiError) -> Response:
    headers = list(_NO_RETRY)
    if err.status == 401:
        headers.append(("WWW-Authenticate", "Bearer"))
    return Response.json(err.status, err.body(), headers)


def _refusal(status: int, message: str) -> Response:
    return error_response(ApiError(status, message))


class AgentEndpoint:
    """Serves episodes on ``host:port`` (port 0: a free one) until :meth:`close`."""

    def __init__(self, *, model: str, host: str = "127.0.0.1", port: int = 0, max_request_bytes: int = 4 << 20):
        self.model = model
        #: The run's key: agents send it as their API key.
        self.api_key = secrets.token_urlsafe(24)
        self._expected = hashlib.sha256(self.api_key.encode()).digest()
        self._episodes: dict[str, EpisodeRecorder] = {}
        self._over: OrderedDict[str, None] = OrderedDict()
        self._server = HttpServer(self._handle, refusal=_refusal, max_body=max_request_bytes)
        self._io = LoopThread("forge-agent-endpoint")
        self.host = host
        try:
            self.port = self._io.call(self._server.start(host, port), timeout=30)
        except OSError as exc:
            self._io.close()
            raise ConfigError(f"environment: the agent endpoint cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "choose another environment.options.port, or 0 for any free port") from None
        except BaseException:
            self._io.close()
            raise

    def base_url(self, episode: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{episode}/v1"

    @contextlib.asynccontextmanager
    async def serving(self, recorder: EpisodeRecorder) -> AsyncIterator[str]:
        """Serve ``recorder``'s episode while the block runs; yields its base URL. When the
        block ends, the episode is closed on the endpoint's loop before this returns: no
        call is recorded after that."""
        episode = secrets.token_urlsafe(16)
        await asyncio.wrap_future(self._on_loop(lambda: self._episodes.__setitem__(episode, recorder)))
        try:
            yield self.base_url(episode)
        finally:
            await asyncio.wrap_future(self._on_loop(lambda: self._finish(episode)))

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._io.close(self._server.close())

    # ------------------------------------------------------------------ the loop's side

    def _on_loop(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``fn`` on the endpoint's loop; the future is done once it ran. Scheduled at
        once, so it runs even when the caller is cancelled while waiting."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                fn()
            finally:
                done.set_result(None)

        try:
            self._io.loop.call_soon_threadsafe(run)
        except RuntimeError:  # the endpoint is closed: nothing is served any more
            done.set_result(None)
        return done

    def _finish(self, episode: str) -> None:
        recorder = self._episodes.pop(episode, None)
        if recorder is not None:
            recorder.close()
            self._over[episode] = None
            while len(self._over) > _REMEMBERED:
                self._over.popitem(last=False)

    def _authorized(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        presented = token.strip().encode("utf-8", "replace") if scheme.lower() == "bearer" else b""
        return hmac.compare_digest(hashlib.sha256(presented).digest(), self._expected)

    async def _handle(self, request: Request) -> Response:
        try:
            return Response.json(200, await self._route(request))
        except ApiError as err:
            return error_response(err)

    async def _route(self, request: Request) -> object:
        if not self._authorized(request):
            raise ApiError(401, "a missing or wrong API key: use the key the run gave this agent",
                           code="invalid_api_key")
        match = _EPISODE_PATH.match(request.path)
        if match is None:
            raise ApiError(404, f"no route {request.path[:100]!r}: this endpoint serves "
                           "/episodes/<episode>/v1/chat/completions and /models", code="unknown_url")
        episode, rest = match.group(1), match.group(2) or "/"
        recorder = self._episodes.get(episode)
        if recorder is None:
            if episode in self._over:
                raise ApiError(410, "this episode is over: its agent ended or ran out of time",
                               code="episode_over")
            raise ApiError(404, "no such episode: use the base_url the run gave this agent",
                           code="unknown_episode")
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "forgerl"}
        if rest.rstrip("/") == "/chat/completions":
            try:
                _method(request, "POST")
                return await recorder.call(parse_request(request.body))
            except ApiError as err:
                recorder.refuse(err)
                raise
        if rest.rstrip("/") == "/models":
            _method(request, "GET")
            return {"object": "list", "data": [model]}
        if rest.startswith("/models/"):
            _method(request, "GET")
            if rest[len("/models/"):] != self.model:
                raise ApiError(404, f"no model {rest[len('/models/'):][:100]!r}; this endpoint serves {self.model!r}",
                               code="model_not_found")
            return model
        raise ApiError(404, f"no route {rest[:100]!r} under an episode: /chat/completions and /models are served",
                       code="unknown_url")


def _method(request: Request, expected: str) -> None:
    if request.method != expected:
        raise ApiError(405, f"use {expected} here, not {request.method[:10]}")
