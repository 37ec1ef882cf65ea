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
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError, RewardError

from .reward_server import SERVED_MODEL_NAME, endpoint_file, log_file, role_name

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.rewards.reward_model_options import Options

#: Largest answer read (a batch of logits is a few KiB per sample).
MAX_RESPONSE_BYTES = 64 << 20


class ServedClassifier:
    """``logits(batch of token-id lists) -> list of logit lists`` through ``/classify``."""

    def __init__(self, options: Options, *, wait: float | None = None) -> None:
        self.options = options
        self.endpoint: Path | None = None
        self.model: str | None = None
        self.instance: str | None = None
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
        return True

    # ------------------------------------------------------------------ scoring

    def logits(self, batch: list[list[int]]) -> list[list[float]]:
        """Raw logits of each token-id list (blocking)."""
        body: dict[str, Any] = {"input": batch, "use_activation": False}
        if self.model is not None:
            body["model"] = self.model
        try:
            answer = self._post(body)
        except OSError as exc:  # could not connect, or the connection broke
            if not self._reattach():
                raise RewardError(f"reward_model: {self.url}/classify failed: {_describe(exc)}") from None
            answer = self._post(body)  # once more, at the restarted server
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
            raise RewardError(
                f"reward_model: {self.url}/classify answered HTTP {exc.code}: {detail}"
            ) from None
        except TimeoutError:
            raise RewardError(
                f"reward_model: {self.url}/classify did not answer in {self.options.request_timeout:g} s"
            ) from None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _describe(exc: OSError) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
