"""A client's handle on one replica of a server role of the run (the served reward model,
the served distillation teacher), or on a server the user runs at a URL.

The role's launcher (:mod:`.launcher`) publishes host, port and key in the replica's
endpoint file once its server is ready, writes ``error`` there when it could not start
it, and removes the file when the server exits; each start gets a new ``instance`` id.
:class:`RoleEndpoint` waits for that file, posts JSON with the run's key, and when a
request cannot connect it re-reads the file once: a restarted server has a new port.
Requests are blocking (standard library): callers run them on a worker thread.

When the run's server fails a request (no connection, no answer in ``timeout``, HTTP 5xx
or 401), the request fails and the server is out of service until its engine answers its
launcher again or a restarted server replaces it (:mod:`.service`, the rule every served
engine's client follows: ``/health`` alone cannot say a wedged engine is back). Callers
wait for it with :meth:`RoleEndpoint.wait_in_service` before their own deadline starts,
as long as a restart may take; a server whose restarts are spent ends the run through its
scheduler. A server the user runs at a URL has no launcher to ask: its failures are the
request's alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError

from . import launcher
from .service import Outage

#: Largest answer read (a batch of logits or logprobs is a few KiB to MiB).
MAX_RESPONSE_BYTES = 64 << 20
#: Seconds between looks at a server out of service.
SERVICE_POLL = 0.25


class _ServerFailed(Exception):
    """The server, not the request, failed: no connection, no answer, HTTP 5xx or 401."""


class RoleEndpoint:
    """Requests to one server (see the module docstring). ``who`` starts every message
    ("reward_model", "teacher"); failures raise ``error`` (the caller's exception type)."""

    def __init__(
        self, *, who: str, what: str, error: type[Exception], timeout: float, allowance: float = 0.0
    ) -> None:
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
        #: How long a server out of service is waited for (as long as a restart may take:
        #: :func:`.service.restart_allowance`); while it is out: since when, and until when.
        self.allowance = allowance
        self.outage: Outage | None = None
        self.out_until = 0.0
        self._lock = threading.Lock()  # request threads and the event loop's waits

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
        wait: float, allowance: float, replica: int = 0,
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
        client = cls(who=who, what=what, error=error, timeout=timeout, allowance=allowance)
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
        self.outage = None
        return True

    # ------------------------------------------------------------------ out of service

    def _take_out(self) -> None:
        with self._lock:
            if self.outage is None or self.outage.instance != self.instance:
                self.out_until = time.monotonic() + self.allowance
            self.outage = Outage(self.endpoint, self.instance)  # counted from the latest failure

    def in_service(self) -> bool:
        """Whether requests may go to the server now: it was not taken out, a restarted
        server replaced it, or its engine answered its launcher since. Raises ``error``
        when its launcher reports that a restarted server failed to start."""
        with self._lock:
            if self.outage is None:
                return True
            assert self.endpoint is not None, "only the run's own server is taken out of service"
            data = read_json(self.endpoint)
            if data is not None and data.get("error"):
                raise self.error(f"{self.who}: {self.what} failed: {data['error']} (log: {self.log})")
            # The same server is back only on its launcher's count: this client has no health
            # check to fall back on (the run's server always has our launcher).
            counted = self.outage.answers is not None
            if self._reattach() or (counted and data is not None and self.outage.over(data.get("instance"))):
                self.outage = None
                return True
            return False

    async def wait_in_service(self) -> None:
        """Return once the server may take requests (at once, unless it was taken out);
        ``error`` when it stayed out of service for as long as a restart may take."""
        while not self.in_service():
            if time.monotonic() >= self.out_until:
                raise self.error(
                    f"{self.who}: {self.what} has not served for {self.allowance:g} s "
                    f"(as long as a restart may take; log: {self.log})"
                )
            await asyncio.sleep(SERVICE_POLL)

    # ------------------------------------------------------------------------ requests

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path``; the decoded answer. A request the server fails is
        tried once more at a restarted server (when the role has one up by now); failing
        that, the run's server is taken out of service (the module docstring)."""
        try:
            try:
                return self._post(path, body)
            except _ServerFailed:
                if not self._reattach():
                    raise
                return self._post(path, body)  # once more, at the restarted server
        except _ServerFailed as exc:
            if self.endpoint is None:  # a server of the user's: nothing says when it is back
                raise self.error(f"{self.who}: {exc}") from None
            self._take_out()
            raise self.error(
                f"{self.who}: {exc}; {self.what} is out of service until it answers again or is restarted, "
                "and requests wait for it"
            ) from None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return json.loads(r.read(MAX_RESPONSE_BYTES))
        except urllib.error.HTTPError as exc:
            detail = exc.read(300).decode(errors="replace").strip()
            said = f"{self.url}{path} answered HTTP {exc.code}: {detail}"
            if exc.code >= 500 or exc.code == 401:  # the engine failed; 401: a restart's new key
                raise _ServerFailed(said) from None
            raise self.error(f"{self.who}: {said}") from None
        except TimeoutError:
            raise _ServerFailed(f"{self.url}{path} did not answer in {self.timeout:g} s") from None
        except ValueError as exc:  # not JSON (or cut at MAX_RESPONSE_BYTES)
            raise self.error(f"{self.who}: {self.url}{path} answered something that is not JSON ({exc})") from None
        except OSError as exc:  # could not connect, or the connection broke
            raise _ServerFailed(f"{self.url}{path} failed: {describe(exc)}") from None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(exc: OSError) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
