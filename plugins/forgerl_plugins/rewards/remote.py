"""The ``remote`` reward: an HTTP scoring service scores each sample.

POSTs ``{"prompt", "completion", "answer", "metadata", "problem_id", "finish_reason"}`` as
JSON to ``url`` and reads ``{"score": float, "components": {name: float}}`` back (the
field names are options). Runs on the run's event loop (``ascore``), the requests
themselves on threads with the standard library's HTTP client, at most ``concurrency`` at
once per process. Connection errors, timeouts, 429 and 5xx answers are retried with
exponential backoff; a sample whose request still fails raises, which the run scores as a
failed sample and goes on.

The auth header's value comes from the environment variable named by ``auth_env``: the
config (and so config.yaml) holds only the variable's name, and no message of this
module includes a header.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import urllib.error
import urllib.request
import weakref
from typing import Any

from pydantic import Field

from forgerl.errors import ConfigError, RewardError
from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput, RewardResult

#: Answers worth asking again: the service is overloaded or briefly down.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class _Retryable(Exception):
    pass


class RemoteReward(Reward):
    name = "remote"
    description = "an HTTP scoring service scores each sample"

    class Options(OptionsModel):
        url: str = Field(
            pattern=r"^https?://", description="Where to POST each sample (http:// or https://)."
        )
        timeout: float = Field(10.0, gt=0, le=3600, description="Seconds per request.")
        retries: int = Field(
            2, ge=0, le=20, description="Retries after a connection error, timeout, 429 or 5xx."
        )
        backoff: float = Field(
            0.5, ge=0, le=60, description="Seconds before the first retry, doubled for each next."
        )
        concurrency: int = Field(16, ge=1, le=4096, description="Requests in flight at once (per process).")
        auth_env: str | None = Field(
            None,
            pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
            description="Name of the environment variable holding the auth token (the token is never in "
            "the config).",
        )
        auth_header: str = Field("Authorization", min_length=1, description="Header the token goes in.")
        auth_scheme: str = Field("Bearer", description="Put before the token ('' for none).")
        score_field: str = Field("score", description="Field of the answer holding the score.")
        components_field: str = Field(
            "components", description="Field of the answer holding named components."
        )
        max_response_bytes: int = Field(1 << 20, ge=64, description="Largest answer read.")

    @staticmethod
    def local_preflight(options: RemoteReward.Options) -> None:
        """Before ``forge run`` starts the trainer on this machine (which inherits this
        environment): the variable ``auth_env`` names is set. Otherwise the reward failed to
        build inside the trainer, after the generator servers had started."""
        if options.auth_env and not os.environ.get(options.auth_env):
            raise ConfigError(
                f"rewards: remote: the environment variable {options.auth_env!r} (options.auth_env) is not "
                "set or empty; export it with the service's token before `forge run`"
            )

    def __init__(self, options: Options):
        self.options = options
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if options.auth_env:
            token = os.environ.get(options.auth_env)
            if not token:
                raise ConfigError(
                    f"remote reward: the environment variable {options.auth_env!r} (options.auth_env) is not set"
                )
            prefix = f"{options.auth_scheme} " if options.auth_scheme else ""
            self.headers[options.auth_header] = prefix + token
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def ascore(self, sample: RewardInput) -> RewardResult:
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = asyncio.Semaphore(self.options.concurrency)
        body = self._body(sample)
        o = self.options
        last = ""
        for attempt in range(o.retries + 1):
            if attempt:
                await asyncio.sleep(o.backoff * 2 ** (attempt - 1))
            async with limit:
                try:
                    answer = await asyncio.to_thread(self._post, body)
                except _Retryable as exc:
                    last = str(exc)
                    continue
            return self._result(answer)
        raise RewardError(f"remote reward: {o.url} failed {o.retries + 1} time(s), last: {last}")

    # ------------------------------------------------------------------ helpers

    def _body(self, sample: RewardInput) -> bytes:
        problem = sample.problem
        payload = {
            "prompt": problem.prompt,
            "completion": sample.completion_text,
            "answer": problem.answer,
            "metadata": dict(problem.metadata),
            "problem_id": problem.id,
            "finish_reason": sample.finish_reason,
        }
        # ensure_ascii: lone surrogates (undecodable bytes) travel as escapes, not as invalid UTF-8.
        return json.dumps(payload, default=str).encode("ascii")

    def _post(self, body: bytes) -> Any:
        request = urllib.request.Request(self.options.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout) as response:  # noqa: S310 - the configured URL
                raw = response.read(self.options.max_response_bytes + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in RETRY_STATUSES:
                raise _Retryable(f"HTTP {exc.code}") from None
            raise RewardError(f"remote reward: {self.options.url} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"{type(exc).__name__}: {reason}") from None
        if len(raw) > self.options.max_response_bytes:
            raise RewardError(
                f"remote reward: the answer is larger than {self.options.max_response_bytes} bytes"
            )
        try:
            return json.loads(raw)
        except ValueError:
            raise RewardError(f"remote reward: the answer is not JSON: {raw[:80]!r}") from None

    def _result(self, answer: Any) -> RewardResult:
        o = self.options
        if not isinstance(answer, dict) or o.score_field not in answer:
            raise RewardError(f"remote reward: the answer has no {o.score_field!r} field: {str(answer)[:80]}")
        value = _number(answer[o.score_field], o.score_field)
        raw_components = answer.get(o.components_field) or {}
        if not isinstance(raw_components, dict):
            raise RewardError(f"remote reward: {o.components_field!r} must be an object of numbers")
        components = {str(k): _number(v, f"{o.components_field}.{k}") for k, v in raw_components.items()}
        return RewardResult(value=value, components=components)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"remote reward: {what} is not a finite number: {value!r:.40}")
    return float(value)
