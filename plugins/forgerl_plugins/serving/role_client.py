"""A client's handle on one replica of a server role of the run (the served reward model,
the served distillation teacher), or on a server the user runs at a URL.

The role's launcher (:mod:`.launcher`) publishes host, port and key in the replica's
endpoint file once its server is ready, writes ``error`` there when it could not start
it, and removes the file when the server exits; each start gets a new ``instance`` id.
:class:`RoleEndpoint` waits for that file, posts JSON with the run's key, and when a
request cannot connect it re-reads the file once: a restarted server has a new port.
Requests are blocking (standard library): callers run them on a worker thread.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError

from . import launcher

#: Largest answer read (a batch of logits or logprobs is a few KiB to MiB).
MAX_RESPONSE_BYTES = 64 << 20


class RoleEndpoint:
    """Requests to one server (see the module docstring). ``who`` starts every message
    ("reward_model", "teacher"); failures raise ``error`` (the caller's exception type)."""

    def __init__(self, *, who: str, what: str, error: type[Exception], timeout: float) -> None:
        self.who = who
        self.what = what  # "the reward model server", in messages
        self.error = error
        self.timeout = timeout  # seconds one request may take
        self.endpoint: Path | None = None
        self.log: Path | None = None
        self.url = ""
        self.headers: dict[str, str] = {"Content-Type": "application/json"}
        self.model: str | None = None
        self.instance: str | None = None
        #: What the endpoint file said (the first request's findings: a classifier's labels).
        self.data: dict[str, Any] = {}

    # --------------------------------------------------------------- where the server is

    @classmethod
    def at_url(
        cls, url: str, *, auth_env: str | None, who: str, what: str, error: type[Exception], timeout: float
    ) -> RoleEndpoint:
        """A server the user runs at ``url``, its key (if any) in the environment variable ``auth_env``."""
        client = cls(who=who, what=what, error=error, timeout=timeout)
        client.url = url.rstrip("/")
        if auth_env:
            key = os.environ.get(auth_env)
            if not key:
                raise ConfigError(f"{who}: the environment variable {auth_env!r} (options.auth_env) is not set")
            client.headers["Authorization"] = f"Bearer {key}"
        return client

    @classmethod
    def of_role(
        cls, role: str, directory: str, *, who: str, what: str, error: type[Exception], timeout: float,
        wait: float, replica: int = 0,
    ) -> RoleEndpoint:
        """Replica ``replica`` of the run's server role ``role`` (endpoint files under
        ``<run_dir>/<directory>``), once it is ready (at most ``wait`` seconds). The run
        directory comes from ``$FORGE_RUN_DIR``, which every process of a run has."""
        run_dir = os.environ.get("FORGE_RUN_DIR")
        if not run_dir:
            raise ConfigError(
                f"{who}: server: vllm starts its server as part of a forge run (FORGE_RUN_DIR is not set); "
                "outside a run, give url: of a running server"
            )
        client = cls(who=who, what=what, error=error, timeout=timeout)
        client.endpoint = launcher.endpoint_file(Path(run_dir), role, replica, directory)
        client.log = launcher.log_file(Path(run_dir), role, replica)
        client._attach(client.wait_for_server(wait))
        return client

    def wait_for_server(self, timeout: float) -> dict[str, Any]:
        """The endpoint file's contents once the server is ready; a launcher's failure or
        ``timeout`` raises, naming the server's log."""
        assert self.endpoint is not None, "only a run's server role has an endpoint file"
        deadline = time.monotonic() + timeout
        while True:
            data = read_json(self.endpoint)
            if data is not None and data.get("error"):
                raise self.error(f"{self.who}: {self.what} failed: {data['error']} (log: {self.log})")
            if data is not None and data.get("port"):
                return data
            if time.monotonic() >= deadline:
                raise self.error(f"{self.who}: {self.what} was not ready after {timeout:g} s (log: {self.log})")
            time.sleep(0.25)

    def _attach(self, data: dict[str, Any]) -> None:
        host = str(data["host"])
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.url = f"http://{host}:{int(data['port'])}"
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {data['api_key']}"}
        self.model = str(data["model"]) if data.get("model") else None
        self.instance = data.get("instance")
        self.data = data

    def _reattach(self) -> bool:
        """Point at a restarted server (a new endpoint file); False when there is none yet."""
        if self.endpoint is None:
            return False
        data = read_json(self.endpoint)
        if data is None or not data.get("port") or data.get("instance") == self.instance:
            return False
        self._attach(data)
        return True

    # ------------------------------------------------------------------------ requests

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path``; the decoded answer. A connection that fails is tried
        once more at a restarted server (when the role has one up by now)."""
        try:
            return self._post(path, body)
        except OSError as exc:  # could not connect, or the connection broke
            if not self._reattach():
                raise self.error(f"{self.who}: {self.url}{path} failed: {describe(exc)}") from None
            return self._post(path, body)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return json.loads(r.read(MAX_RESPONSE_BYTES))
        except urllib.error.HTTPError as exc:
            detail = exc.read(300).decode(errors="replace").strip()
            raise self.error(f"{self.who}: {self.url}{path} answered HTTP {exc.code}: {detail}") from None
        except TimeoutError:
            raise self.error(f"{self.who}: {self.url}{path} did not answer in {self.timeout:g} s") from None
        except ValueError as exc:  # not JSON (or cut at MAX_RESPONSE_BYTES)
            raise self.error(f"{self.who}: {self.url}{path} answered something that is not JSON ({exc})") from None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(exc: OSError) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
