"""How the ``reward_model`` reward scores through a vLLM pooling server.

The reward renders and tokenizes each sample itself (the same text and the same
left-truncated token ids as in-process scoring), and POSTs a batch of token-id lists to
the server's ``/classify`` with ``use_activation: false``: the answer holds each sample's
raw logits, to which the reward applies its own activation. Both ways of scoring thus
share everything but the forward pass.

The server is the run's own (``server: vllm``: its launcher, :mod:`.reward_server`,
publishes host, port and key in an endpoint file under the run directory, found through
``$FORGE_RUN_DIR``) or one the user runs (``url``, its key from ``auth_env``). Requests
are blocking (standard library) and run on the reward's worker thread. A request that
cannot connect re-reads the endpoint file once: a restarted server has a new port.

When the run's server fails a request (no connection, no answer in ``request_timeout``,
HTTP 5xx), the samples of that request fail, and the server is out of service until its
engine answers its launcher again or a restarted server replaces it
(:mod:`forgerl_plugins.serving.service`, the rule every served engine's client follows).
Samples that come meanwhile wait for it (:meth:`ServedClassifier.wait_in_service`, which
the reward awaits before a sample's ``loop.reward_timeout`` starts), as long as a restart
may take; a server whose restarts are spent ends the run through its scheduler.
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
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError, RewardError
from forgerl_plugins.serving.service import Outage, restart_allowance

from .reward_server import LIVENESS_TIMEOUT, SERVED_MODEL_NAME, endpoint_file, log_file, role_name

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.rewards.reward_model import RewardModelReward

#: Largest answer read (a batch of logits is a few KiB per sample).
MAX_RESPONSE_BYTES = 64 << 20
#: Seconds between looks at a server out of service.
SERVICE_POLL = 0.25


class _ServerFailed(Exception):
    """The server, not the request, failed: no connection, no answer, HTTP 5xx or 401."""


class ServedClassifier:
    """``logits(batch of token-id lists) -> list of logit lists`` through ``/classify``."""

    def __init__(self, options: RewardModelReward.Options, *, wait: float | None = None) -> None:
        self.options = options
        self.endpoint: Path | None = None
        self.model: str | None = None
        self.instance: str | None = None
        #: While the run's server is out of service: since when, and until when it is
        #: waited for (as long as a restart may take).
        self.outage: Outage | None = None
        self.out_until = 0.0
        self.allowance = restart_allowance(startup_timeout=options.startup_timeout, liveness_timeout=LIVENESS_TIMEOUT)
        self._lock = threading.Lock()  # scoring threads and the event loop's waits
        if options.url is not None:
            self.url = options.url.rstrip("/")
            self.headers = {"Content-Type": "application/json"}
            if options.auth_env:
                key = os.environ.get(options.auth_env)
                if not key:
                    raise ConfigError(
                        f"reward_model: the environment variable {options.auth_env!r} (options.auth_env) is not set"
                    )
                self.headers["Authorization"] = f"Bearer {key}"
            return
        run_dir = os.environ.get("FORGE_RUN_DIR")
        if not run_dir:
            raise ConfigError(
                "reward_model: server: vllm starts its server as part of a forge run (FORGE_RUN_DIR is not set); "
                "outside a run, give url: of a running vLLM pooling server"
            )
        role = role_name(options)
        self.endpoint = endpoint_file(Path(run_dir), role)
        self.log = log_file(Path(run_dir), role)
        self._attach(self.wait_for_server(options.startup_timeout if wait is None else wait))

    # ------------------------------------------------------------ the run's server

    def wait_for_server(self, timeout: float) -> dict[str, Any]:
        """The endpoint file's contents once the server is ready; a launcher's failure or
        ``timeout`` raises, naming the server's log."""
        assert self.endpoint is not None
        deadline = time.monotonic() + timeout
        while True:
            data = _read_json(self.endpoint)
            if data is not None and data.get("error"):
                raise RewardError(
                    f"reward_model: the reward model server failed: {data['error']} (log: {self.log})"
                )
            if data is not None and data.get("port"):
                return data
            if time.monotonic() >= deadline:
                raise RewardError(
                    f"reward_model: the reward model server was not ready after {timeout:g} s (log: {self.log})"
                )
            time.sleep(0.25)

    def _attach(self, data: dict[str, Any]) -> None:
        host = str(data["host"])
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.url = f"http://{host}:{int(data['port'])}"
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {data['api_key']}"}
        self.model = str(data.get("model") or SERVED_MODEL_NAME)
        self.instance = data.get("instance")

    def _reattach(self) -> bool:
        """Point at a restarted server (a new endpoint file); False when there is none yet."""
        if self.endpoint is None:
            return False
        data = _read_json(self.endpoint)
        if data is None or not data.get("port") or data.get("instance") == self.instance:
            return False
        self._attach(data)
        self.outage = None
        return True

    def _take_out(self) -> None:
        with self._lock:
            if self.outage is None or self.outage.instance != self.instance:
                self.out_until = time.monotonic() + self.allowance
            self.outage = Outage(self.endpoint, self.instance)  # counted from the latest failure

    def in_service(self) -> bool:
        """Whether samples may go to the server now: it was not taken out, a restarted
        server replaced it, or its engine answered its launcher since. Raises RewardError
        when its launcher reports that a restarted server failed to start."""
        with self._lock:
            if self.outage is None:
                return True
            assert self.endpoint is not None, "only the run's own server is taken out of service"
            data = _read_json(self.endpoint)
            if data is not None and data.get("error"):
                raise RewardError(f"reward_model: the reward model server failed: {data['error']} (log: {self.log})")
            # The same server is back only on its launcher's count: this client has no health
            # check to fall back on (the run's server always has our launcher).
            counted = self.outage.answers is not None
            if self._reattach() or (counted and data is not None and self.outage.over(data.get("instance"))):
                self.outage = None
                return True
            return False

    async def wait_in_service(self) -> None:
        """Return once the server may take samples (at once, unless it was taken out);
        RewardError when it stayed out of service for as long as a restart may take."""
        while not self.in_service():
            if time.monotonic() >= self.out_until:
                raise RewardError(
                    f"reward_model: the reward model server has not served for {self.allowance:g} s "
                    f"(as long as a restart may take; log: {self.log})"
                )
            await asyncio.sleep(SERVICE_POLL)

    # ------------------------------------------------------------------ scoring

    def logits(self, batch: list[list[int]]) -> list[list[float]]:
        """Raw logits of each token-id list (blocking)."""
        body: dict[str, Any] = {"input": batch, "use_activation": False}
        if self.model is not None:
            body["model"] = self.model
        try:
            try:
                answer = self._post(body)
            except _ServerFailed:
                if not self._reattach():
                    raise
                answer = self._post(body)  # once more, at the restarted server
        except _ServerFailed as exc:
            if self.endpoint is None:  # a server of the user's: nothing says when it is back
                raise RewardError(f"reward_model: {exc}") from None
            self._take_out()
            raise RewardError(
                f"reward_model: {exc}; the server is out of service until it answers again or is restarted, "
                "and samples wait for it"
            ) from None
        data = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
        if len(data) != len(batch):
            raise RewardError(
                f"reward_model: /classify answered {len(data)} results for {len(batch)} samples"
            )
        return [[float(v) for v in d["probs"]] for d in data]

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + "/classify", data=json.dumps(body).encode(), headers=self.headers
        )
        try:
            with urllib.request.urlopen(request, timeout=self.options.request_timeout) as r:
                return json.loads(r.read(MAX_RESPONSE_BYTES))
        except urllib.error.HTTPError as exc:
            detail = exc.read(300).decode(errors="replace").strip()
            said = f"{self.url}/classify answered HTTP {exc.code}: {detail}"
            if exc.code >= 500 or exc.code == 401:  # the engine failed; 401: a restart's new key
                raise _ServerFailed(said) from None
            raise RewardError(f"reward_model: {said}") from None
        except TimeoutError:
            raise _ServerFailed(
                f"{self.url}/classify did not answer in {self.options.request_timeout:g} s"
            ) from None
        except OSError as exc:  # could not connect, or the connection broke
            raise _ServerFailed(f"{self.url}/classify failed: {_describe(exc)}") from None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _describe(exc: OSError) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
