"""The ``model`` teacher through a server: prompt logprobs of token-id prompts.

One POST to ``/v1/completions`` scores a batch of sequences: ``prompt`` is the list of
token-id lists, ``prompt_logprobs: 1`` asks for the logprob of every prompt token after
the first (with the model's most likely token beside it), ``max_tokens: 1`` (vLLM needs
at least one generated token; it is ignored), ``temperature: 1`` (prompt logprobs are the
model's own distribution in vLLM whatever the sampling settings, said here anyway) and
``return_token_ids`` so the answer says which tokens the server saw: an answer about other
tokens than asked is refused, not trusted. vLLM's answer per choice (``index`` = the
prompt's position)::

    {"prompt_token_ids": [...], "prompt_logprobs": [null, {"<id>": {"logprob": -1.2, "rank": 3}, "<top>": {...}}, ...]}

The run's server (``server: vllm``) is found, waited for and followed across restarts by
the served roles' shared client (:class:`forgerl_plugins.serving.role_client.RoleEndpoint`);
a server the user runs is at ``url`` (its API root), its key from ``auth_env``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from forgerl.errors import TeacherError
from forgerl.teacher import TeacherRequest, TeacherScores
from forgerl_plugins.serving.role_client import RoleEndpoint
from forgerl_plugins.serving.service import restart_allowance

from .server import ENDPOINT_DIR, LIVENESS_TIMEOUT, SERVED_MODEL_NAME, completion_body, role_name

if TYPE_CHECKING:  # pragma: no cover
    from .options import Options

WHO, WHAT = "teacher", "the teacher's server"


class ServedTeacher:
    """``score(requests) -> scores`` through a server's ``/v1/completions`` (blocking)."""

    def __init__(self, options: Options) -> None:
        timeout = options.request_timeout
        if options.url is not None:
            self.server = RoleEndpoint.at_url(
                options.url, auth_env=options.auth_env, who=WHO, what=WHAT, error=TeacherError, timeout=timeout
            )
            self.server.model = options.served_model
            self.path = "/completions"  # url is the API root (…/v1), as OpenAI clients take it
        else:
            allowance = restart_allowance(startup_timeout=options.startup_timeout, liveness_timeout=LIVENESS_TIMEOUT)
            self.server = RoleEndpoint.of_role(
                role_name(options), ENDPOINT_DIR, wait=options.startup_timeout, allowance=allowance,
                who=WHO, what=WHAT, error=TeacherError, timeout=timeout,
            )  # fmt: skip
            self.server.model = self.server.model or SERVED_MODEL_NAME
            self.path = "/v1/completions"

    def score(self, requests: list[TeacherRequest]) -> list[TeacherScores]:
        body: dict[str, Any] = completion_body([list(r.token_ids) for r in requests])
        if self.server.model is not None:
            body["model"] = self.server.model
        answer = self.server.post(self.path, body)
        return parse_answer(answer, requests)


def parse_answer(answer: Any, requests: list[TeacherRequest]) -> list[TeacherScores]:
    """The scores of each request from a completions answer; TeacherError for an answer
    that does not hold them (a server's answer is checked, not trusted)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != len(requests):
        got = len(choices) if isinstance(choices, list) else "no"
        raise TeacherError(f"teacher: the server answered {got} choices for {len(requests)} sequences")
    by_index = {c.get("index"): c for c in choices if isinstance(c, dict)}
    out = []
    for i, request in enumerate(requests):
        choice = by_index.get(i)
        if choice is None:
            raise TeacherError(f"teacher: the server's answer has no choice {i}")
        out.append(_scores(choice, request, i))
    return out


def _scores(choice: dict[str, Any], request: TeacherRequest, index: int) -> TeacherScores:
    seen = choice.get("prompt_token_ids")
    if seen is not None and list(seen) != list(request.token_ids):
        raise TeacherError(f"teacher: the server scored other tokens than sent for sequence {index}")
    positions = choice.get("prompt_logprobs")
    if not isinstance(positions, list) or len(positions) != len(request.token_ids):
        raise TeacherError(
            f"teacher: the server gave no prompt_logprobs for every token of sequence {index} "
            "(does it support prompt_logprobs? vLLM's OpenAI server does)"
        )
    logprobs: list[float] = []
    top1: list[int] | None = []
    for t in range(request.start, len(request.token_ids)):
        entry = positions[t]
        token = request.token_ids[t]
        if not isinstance(entry, dict) or str(token) not in entry:
            raise TeacherError(f"teacher: no logprob of token {token} at position {t} of sequence {index}")
        value = _logprob(entry[str(token)])
        if value is None:
            raise TeacherError(f"teacher: the logprob of token {token} at position {t} is not a number")
        logprobs.append(value)
        best = _top1(entry)
        if best is None or top1 is None:
            top1 = None  # the server does not say: no agreement for this sequence
        else:
            top1.append(best)
    return TeacherScores(logprobs, top1)


def _logprob(item: Any) -> float | None:
    value = item.get("logprob") if isinstance(item, dict) else item
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _top1(entry: dict[str, Any]) -> int | None:
    """The id of rank 1 in one position's logprobs (vLLM lists the sampled token and the
    top ``prompt_logprobs``, each with its rank)."""
    for key, item in entry.items():
        if isinstance(item, dict) and item.get("rank") == 1:
            try:
                return int(key)
            except ValueError:
                return None
    return None
