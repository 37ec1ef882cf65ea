"""Every path of a forgerl vLLM server needs the run's key.

The servers run in vLLM's dev mode (weight updates go through ``/collective_rpc``,
``/pause``, ``/resume``, ``/reset_prefix_cache``), and vLLM's own ``--api-key`` check
guards only ``/v1``-style paths. The plugin's middleware (plugins/forgerl_plugins/serving/vllm_auth.py)
guards every path. The first tests drive the middleware with plain ASGI messages; the
rest call every route of one real server, started through the plugin's server role exactly
as a run does (the session's shared one: tests/helpers/shared_vllm.py), without the key,
with a wrong key and with the right one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled

pytestmark = [pytest.mark.integration]

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"
)
#: The dev-mode admin routes found open before the middleware (and the two /v1 ones).
MUST_BE_GUARDED = {
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
}
#: Served by the app but absent from its OpenAPI schema (FastAPI's docs, the metrics app).
NOT_IN_SCHEMA = {
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    ("GET", "/metrics"),
    ("GET", "/no/such/path"),  # refused before routing: a 401, not a 404
    ("OPTIONS", "/v1/completions"),  # a CORS preflight gets no pass either
}


# ------------------------------------------------------------ the middleware alone


def _call(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _guarded(key: str = "the-key") -> tuple[Any, list[dict[str, Any]]]:
    from forgerl_plugins.serving.vllm_auth import RequireRunKey

    reached: list[dict[str, Any]] = []

    async def inner(scope, receive, send):
        reached.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    return RequireRunKey(inner, key=key), reached


def _http(path: str, authorization: bytes | None, method: str = "POST") -> dict[str, Any]:
    headers = [(b"host", b"x")] + ([(b"authorization", authorization)] if authorization is not None else [])
    return {"type": "http", "method": method, "path": path, "headers": headers}


@pytest.mark.parametrize(
    "authorization",
    [None, b"", b"Bearer", b"Bearer wrong", b"Bearer the-key-and-more", b"Basic the-key", b"the-key"],
)
def test_middleware_refuses_a_request_without_the_key(authorization):
    app, reached = _guarded()
    sent = _call(app, _http("/collective_rpc", authorization))
    assert sent[0]["status"] == 401, sent
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert not reached, "the request reached the app"


@pytest.mark.parametrize("authorization", [b"Bearer the-key", b"bearer the-key", b"Bearer  the-key "])
def test_middleware_passes_a_request_with_the_key(authorization):
    app, reached = _guarded()
    assert _call(app, _http("/collective_rpc", authorization))[0]["status"] == 200
    assert len(reached) == 1


def test_middleware_passes_lifespan_and_closes_websockets_without_the_key():
    app, reached = _guarded()
    _call(app, {"type": "lifespan"})
    assert [s["type"] for s in reached] == ["lifespan"], "start-up events must reach the app"
    sent = _call(app, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert sent == [{"type": "websocket.close", "code": 1008}] and len(reached) == 1


def test_middleware_fails_closed_without_a_key(monkeypatch):
    from forgerl_plugins.serving.vllm_auth import KEY_ENV, RequireRunKey

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV):
        RequireRunKey(lambda *a: None)
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert RequireRunKey(lambda *a: None).allows(_http("/", b"Bearer from-env"))


def test_the_key_travels_in_the_environment_and_the_middleware_on_the_command_line(tmp_path):
    from forgerl_plugins.generators.vllm import server
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator
    from forgerl_plugins.serving.vllm_auth import KEY_ENV, MIDDLEWARE

    command = server.server_command(VLLMGenerator.Options(), tmp_path, "float32", 1234)
    assert command[command.index("--middleware") + 1] == MIDDLEWARE
    assert "--api-key" not in command, "a key on the command line is visible to every user through ps"
    assert server.server_env(VLLMGenerator.Options(), "k3y")[KEY_ENV] == "k3y"
    module, attr = MIDDLEWARE.rsplit(".", 1)
    assert getattr(importlib.import_module(module), attr).__name__ == "RequireRunKey"


# -------------------------------------------------------------- one real server


@pytest.fixture(scope="module")
def endpoint(shared_vllm):
    """The session's vLLM server (tests/helpers/shared_vllm.py): one replica the local
    scheduler started from the plugin's role, as in a run. Its endpoint file's contents
    (host, port, key), once it serves the model folder's weights."""
    return shared_vllm.endpoint()


def _request(
    ep: dict[str, Any], method: str, path: str, key: str | None, body: Any = None, scheme: str = "Bearer"
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"{scheme} {key}"
    data = None if body is None and method in ("GET", "OPTIONS") else json.dumps(body or {}).encode()
    request = urllib.request.Request(
        f"http://{ep['host']}:{ep['port']}{path}", data=data, headers=headers, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=scaled(60)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _routes(ep: dict[str, Any]) -> set[tuple[str, str]]:
    """Every (method, path) the server's OpenAPI schema lists, path parameters filled in."""
    status, raw = _request(ep, "GET", "/openapi.json", ep["api_key"])
    assert status == 200, f"/openapi.json with the key: HTTP {status}"
    routes = set()
    for path, methods in json.loads(raw)["paths"].items():
        concrete = "/".join("x" if part.startswith("{") else part for part in path.split("/"))
        routes |= {(m.upper(), concrete) for m in methods if m.upper() in ("GET", "POST", "PUT", "DELETE")}
    return routes


@needs_vllm
def test_every_route_refuses_a_request_without_the_right_key(endpoint):
    routes = _routes(endpoint)
    missing = {r for r in MUST_BE_GUARDED if r not in routes}
    assert not missing, f"the server does not serve {sorted(missing)}: not in dev mode?"
    assert len(routes) >= 20, f"only {len(routes)} routes listed: {sorted(routes)}"
    open_routes = []
    for method, path in sorted(routes | NOT_IN_SCHEMA):
        for label, key, scheme in (
            ("no key", None, "Bearer"),
            ("a wrong key", endpoint["api_key"] + "x", "Bearer"),
            ("the key as Basic", endpoint["api_key"], "Basic"),
        ):
            status, body = _request(endpoint, method, path, key, scheme=scheme)
            if status != 401:
                open_routes.append(f"{method} {path} with {label}: HTTP {status} {body[:80]!r}")
    assert not open_routes, "answered without the right key:\n" + "\n".join(open_routes)


@needs_vllm
def test_the_right_key_is_let_through(endpoint):
    key = endpoint["api_key"]
    served = _routes(endpoint) | NOT_IN_SCHEMA
    read_only = sorted(r for r in served if r[0] == "GET" and r[1] != "/no/such/path")
    refused = [f"GET {p}: {s}" for _, p in read_only if (s := _request(endpoint, "GET", p, key)[0]) == 401]
    assert not refused, f"the key was refused: {refused}"
    # The admin routes a weight update uses, called as the generator calls them.
    calls = [
        ("POST", "/collective_rpc", {"method": "forge_policy_version"}),
        ("POST", "/pause", None),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/resume", None),
        (
            "POST",
            "/v1/completions",
            {"model": endpoint["model"], "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0},
        ),
    ]
    # All of them, then the verdict: the server is shared, and a failure must not leave it paused.
    answers = [(method, path, *_request(endpoint, method, path, key, body=body)) for method, path, body in calls]
    refused = [f"{m} {p}: HTTP {status} {raw[:200]!r}" for m, p, status, raw in answers if status != 200]
    assert not refused, f"refused with the key: {refused}"
    status, raw = _request(endpoint, "POST", "/collective_rpc", key, body={"method": "forge_policy_version"})
    assert status == 200, f"/collective_rpc with the key: HTTP {status}"
    assert [int(v) for v in json.loads(raw)["results"]] == [0], f"the model folder's weights are version 0: {raw!r}"


@needs_vllm
def test_the_key_is_not_on_any_command_line(endpoint):
    """`ps` shows every user the command lines of every process: the key must not be there."""
    key = endpoint["api_key"].encode()
    leaked = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if key in cmdline:
            shown = cmdline.replace(b"\0", b" ")[:200]
            leaked.append(f"pid {proc.name}: {shown!r}")
    assert not leaked, f"the run's key is on a command line: {leaked}"
