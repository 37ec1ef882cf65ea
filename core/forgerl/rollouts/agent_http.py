"""A small HTTP/1.1 server on asyncio, for the agent endpoint (:mod:`forgerl.rollouts.agent_endpoint`).

Why not a web framework: the core depends on none (aiohttp, uvicorn and starlette arrive
only with the vLLM extra), and the endpoint needs four routes with JSON bodies. What it
serves is what OpenAI clients send: requests with a ``Content-Length`` body, on kept-alive
connections. Everything else is refused, and every read is bounded, because an agent's
requests carry model-written text and the agent itself may be broken:

- the request line and headers: at most ``max_head`` bytes, read within ``head_timeout``
  (431 / connection closed);
- the body: a ``Content-Length`` of at most ``max_body`` bytes (413), read within
  ``body_timeout``; ``Transfer-Encoding`` (chunked bodies) is refused (501);
- connections: at most ``max_connections`` at once (503), idle ones closed after
  ``idle_timeout``.

A handler that raises answers 500 (logged); the connection stays usable.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

log = logging.getLogger("forgerl.rollouts.agent_endpoint")


@dataclass(frozen=True)
class Request:
    method: str
    #: The path, without its query string.
    path: str
    #: Header names in lower case (a repeated header: its last value).
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(cls, status: int, value: object, headers: list[tuple[str, str]] | None = None) -> Response:
        return cls(status, json.dumps(value).encode(), [("Content-Type", "application/json"), *(headers or [])])


Handler = Callable[[Request], Awaitable[Response]]
#: The answer to a request the server itself refuses (before any handler sees it).
Refusal = Callable[[int, str], Response]


def plain_refusal(status: int, message: str) -> Response:
    return Response.json(status, {"error": message})


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class HttpServer:
    """Serves ``handler`` on ``host:port`` (0: a free port) once :meth:`start` ran, on the
    event loop that ran it."""

    def __init__(
        self,
        handler: Handler,
        *,
        refusal: Refusal = plain_refusal,
        max_body: int = 4 << 20,
        max_head: int = 64 << 10,
        max_connections: int = 256,
        head_timeout: float = 30.0,
        body_timeout: float = 60.0,
        idle_timeout: float = 120.0,
    ):
        self.handler = handler
        self.refusal = refusal
        self.max_body = max_body
        self.max_head = max_head
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.idle_timeout = idle_timeout
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; the port bound."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=self.max_head)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None, "a connection is served by a task"
        self._connections.add(task)
        try:
            if len(self._connections) > self.max_connections:
                await self._send(writer, self.refusal(503, "too many connections to the agent endpoint"), close=True)
                return
            keep_alive = True
            first = True
            while keep_alive:
                try:
                    request, keep_alive = await self._read(reader, first)
                except _Refused as exc:
                    await self._send(writer, self.refusal(exc.status, str(exc)), close=True)
                    await _linger(reader, writer)
                    return
                if request is None:
                    return
                first = False
                try:
                    response = await self.handler(request)
                except Exception:  # one request's bug, not the end of the server
                    log.exception("the agent endpoint failed to answer %s %s", request.method, request.path[:200])
                    response = self.refusal(500, "the endpoint failed to answer this request (see the run's log)")
                await self._send(writer, response, close=not keep_alive)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # The server is closing. Ended here, not re-raised: asyncio (3.11) logs a
            # connection task that ends cancelled as an unhandled exception.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, first: bool) -> tuple[Request | None, bool]:
        """The next request and whether the connection stays open after it; (None, False)
        when the client closed the connection or stayed idle too long."""
        try:
            head = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), self.head_timeout if first else self.idle_timeout
            )
        except asyncio.LimitOverrunError:
            raise _Refused(431, f"request line and headers over {self.max_head} bytes") from None
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            return None, False
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _Refused(400, "malformed request line") from None
        if not version.startswith("HTTP/1."):
            raise _Refused(505, "HTTP/1.x only")
        headers: dict[str, str] = {}
        lengths = []
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _Refused(400, "malformed header line")
            name = name.lower()
            headers[name] = value.strip()
            if name == "content-length":
                lengths.append(value.strip())
        if "transfer-encoding" in headers:
            raise _Refused(501, "Transfer-Encoding is not supported: send the body with a Content-Length")
        if len(set(lengths)) > 1 or (lengths and not lengths[0].isdigit()):
            raise _Refused(400, "a bad Content-Length")
        size = int(lengths[0]) if lengths else 0
        if size > self.max_body:
            raise _Refused(413, f"the body has {size} bytes; at most {self.max_body}")
        try:
            body = await asyncio.wait_for(reader.readexactly(size), self.body_timeout) if size else b""
        except asyncio.TimeoutError:
            raise _Refused(408, f"the body did not arrive within {self.body_timeout:g} s") from None
        connection = headers.get("connection", "").lower()
        keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
        return Request(method, target.split("?", 1)[0], headers, body), keep_alive

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, response: Response, *, close: bool) -> None:
        try:
            reason = HTTPStatus(response.status).phrase
        except ValueError:
            reason = "Status"
        head = [f"HTTP/1.1 {response.status} {reason}", f"Content-Length: {len(response.body)}",
                f"Connection: {'close' if close else 'keep-alive'}"]
        head += [f"{name}: {value}" for name, value in response.headers]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body)
        await writer.drain()


#: A refused request's client may still be sending its body: closing with unread bytes
#: makes the kernel reset the connection, and the client sees "broken pipe" instead of
#: the refusal it was sent. So the server half-closes and discards what still arrives,
#: for at most this long and this much (a lingering close).
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 << 20


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LINGER_SECONDS
    discarded = 0
    try:
        if writer.can_write_eof():
            writer.write_eof()
        while discarded < _LINGER_BYTES:
            left = deadline - loop.time()
            if left <= 0:
                return
            chunk = await asyncio.wait_for(reader.read(1 << 16), left)
            if not chunk:
                return
            discarded += len(chunk)
    except (ConnectionError, asyncio.TimeoutError, OSError):
        return

