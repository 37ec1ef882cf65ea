"""Every path of a forgerl SGLang server needs the run's key, as every path of a vLLM one does.

SGLang's own ``--api-key`` check lets ``/health``, ``/health_generate``, ``/metrics`` and CORS
preflights through, and takes the key only on its command line, which ``ps`` shows every user.
The plugin starts its servers under :mod:`forgerl_plugins.generators.sglang.guard`, which puts
the run's key check in front of the whole app and keeps the key off the command line. SGLang
has no CPU build, so one server of the SGLang test double (tests/helpers/sglang_double.py:
SGLang's routes, its flags, and its key check with the same exemptions) is started through the
plugin's server role by the local scheduler, exactly as a run starts it, and called on every
route without the key, with a wrong key and with the right one. The first tests run the guard
on a bare ASGI app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled

from .test_sglang_double import PLUGIN, _options

pytestmark = [pytest.mark.integration]

#: Open on SGLang itself without the key (its own check's exemptions), and the admin routes.
MUST_BE_GUARDED = {
    ("GET", "/health"),
    ("GET", "/model_info"),
    ("POST", "/generate"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/pause_generation"),
}
#: Not served by the app (a real SGLang serves /metrics with enable_metrics), or not a route.
NOT_IN_SCHEMA = {
    ("GET", "/metrics"),
    ("GET", "/no/such/path"),  # refused before routing: a 401, not a 404
    ("OPTIONS", "/generate"),  # a CORS preflight gets no pass either
}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One replica of the double behind the real launcher, under the local scheduler; its
    endpoint file's contents (host, port, key) once it serves."""
    from forgerl.testing.generator_support import open_site, tiny_model
    from forgerl_plugins.generators.sglang.server import endpoint_file

    model = tiny_model(tmp_path_factory.mktemp("model"), {}, ())
    run_dir = tmp_path_factory.mktemp("run")
    with open_site("sglang_double", _options(), (PLUGIN,), model, run_dir):
        yield json.loads(endpoint_file(run_dir, 0).read_text())


def _request(ep: dict[str, Any], method: str, path: str, key: str | None, scheme: str = "Bearer") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Origin": "http://elsewhere.example"}
    if key is not None:
        headers["Authorization"] = f"{scheme} {key}"
    if method == "OPTIONS":
        headers["Access-Control-Request-Method"] = "POST"
    data = None if method in ("GET", "OPTIONS") else b"{}"
    request = urllib.request.Request(f"http://{ep['host']}:{ep['port']}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=scaled(60)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _routes() -> set[tuple[str, str]]:
    """Every (method, path) the double's app serves, read from the app itself."""
    from tests.helpers.sglang_double import build_app

    routes = set()
    for route in build_app(None, "unused").routes:
        methods = getattr(route, "methods", None) or ()
        routes |= {(m, route.path) for m in methods if m in ("GET", "POST", "PUT", "DELETE")}
    return routes


def test_every_route_refuses_a_request_without_the_right_key(endpoint: dict[str, Any]) -> None:
    routes = _routes()
    missing = {r for r in MUST_BE_GUARDED if r not in routes}
    assert not missing, f"the server does not serve {sorted(missing)}"
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


def test_the_right_key_is_let_through(endpoint: dict[str, Any]) -> None:
    key = endpoint["api_key"]
    for path in ("/health", "/model_info", "/double/calls"):
        status, raw = _request(endpoint, "GET", path, key)
        assert status == 200, f"GET {path} with the key: HTTP {status} {raw[:200]!r}"


def test_the_key_is_not_on_any_command_line(endpoint: dict[str, Any]) -> None:
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


# ------------------------------------------------------------------ the guard alone

APP = textwrap.dedent(
    """
    import sys
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    print("argv", sys.argv[1:], flush=True)
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), workers=int(sys.argv[2]), log_level="warning")
    """
)


def _guarded(tmp_path: Path, *argv: str, key: str | None = "s3cret") -> subprocess.CompletedProcess[str]:
    script = tmp_path / "app.py"
    script.write_text(APP)
    env = {k: v for k, v in os.environ.items() if k != "FORGE_SGLANG_KEY"}
    if key is not None:
        env["FORGE_SGLANG_KEY"] = key
    return subprocess.run([sys.executable, "-m", "forgerl_plugins.generators.sglang.guard", str(script), *argv],
                          env=env, capture_output=True, text=True, timeout=scaled(60))


def test_the_guard_refuses_to_serve_without_a_key(tmp_path: Path) -> None:
    proc = _guarded(tmp_path, "1", "1", key=None)
    assert proc.returncode != 0 and "FORGE_SGLANG_KEY" in proc.stderr, proc.stderr
    assert "argv" not in proc.stdout, "the program ran"


def test_the_guard_refuses_uvicorn_workers_it_cannot_reach(tmp_path: Path) -> None:
    proc = _guarded(tmp_path, "1", "2")
    assert proc.returncode != 0 and "workers" in proc.stderr, proc.stderr
    # The program saw the key as its own --api-key argument, not on the kernel's command line.
    assert "'--api-key=s3cret'" in proc.stdout, proc.stdout
