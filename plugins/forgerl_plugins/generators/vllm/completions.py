"""A :class:`~forgerl.types.GenerationRequest` as a vLLM ``/v1/completions`` body, and the
answer as :class:`~forgerl.types.Completion` objects.

One request per prompt: ``n`` completions, the prompt as token ids, ``logprobs: 0`` (the
sampled token's logprob) and ``return_token_ids``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError
from forgerl.types import Completion, FinishReason, GenerationRequest
from forgerl_plugins.generators.common.client import error_message
from forgerl_plugins.generators.common.pool import ReplicaFailed
from forgerl_plugins.generators.common.replica import Replica

__all__ = ["ReplicaFailed", "parse_completions", "request_body"]

if TYPE_CHECKING:  # pragma: no cover
    import httpx

FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def request_body(request: GenerationRequest, r: Replica, *, send_seed: bool) -> dict[str, Any]:
    """The body for ``r`` (its model name; ``max_tokens`` cut to its context)."""
    prompt = [int(t) for t in request.prompt_token_ids]
    if not prompt:
        raise GeneratorError(f"request {request.request_id!r} has an empty prompt")
    s = request.sampling
    max_tokens = s.max_tokens
    if r.max_model_len is not None:
        room = r.max_model_len - len(prompt)
        if room <= 0:
            raise GeneratorError(
                f"request {request.request_id!r}: its prompt of {len(prompt)} tokens fills the "
                f"served context of {r.max_model_len} (generator.options.max_model_len)"
            )
        max_tokens = min(max_tokens, room)
    body: dict[str, Any] = {
        "model": r.model,
        "prompt": prompt,
        # vLLM refuses n > 1 with greedy sampling: one greedy completion stands for all.
        "n": request.n if s.temperature > 0 else 1,
        "max_tokens": max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "logprobs": 0,  # the sampled token's logprob only
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.stop:
        body["stop"] = list(s.stop)
    if send_seed and s.seed is not None:
        body["seed"] = int(s.seed)
    return body


def parse_completions(request: GenerationRequest, resp: httpx.Response, version: int) -> list[Completion]:
    """The ``n`` completions of ``resp``, labelled with weights ``version``. Raises
    ReplicaFailed where another replica (or a restarted one) should be asked instead,
    GeneratorError where the request itself is at fault."""
    if resp.status_code >= 500 or resp.status_code in (401, 403):
        # 5xx: the engine failed (it may be dying); 401: the replica restarted with a
        # new key. Either way another replica (or the restarted one) should answer.
        raise ReplicaFailed(f"HTTP {resp.status_code}: {error_message(resp)}")
    if resp.status_code != 200:
        raise GeneratorError(
            f"vLLM rejected request {request.request_id!r} (HTTP {resp.status_code}): {error_message(resp)}"
        )
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    if any(c.get("finish_reason") == "abort" for c in choices):
        # Not one of our updates (those are caught by Replica.aborts): the server's own.
        raise ReplicaFailed("the server aborted the request")
    if request.sampling.temperature <= 0 and len(choices) == 1:
        choices = choices * request.n  # greedy: every completion is the same
    if len(choices) != request.n:
        raise GeneratorError(
            f"request {request.request_id!r}: asked for {request.n} completions, got {len(choices)}"
        )
    out = []
    for c in choices:
        tokens = [int(t) for t in c.get("token_ids") or []]
        logprobs = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(tokens):
            raise GeneratorError(
                f"request {request.request_id!r}: vLLM returned {len(tokens)} tokens but "
                f"{len(logprobs)} logprobs"
            )
        finish = FINISH.get(str(c.get("finish_reason")), "stop")
        out.append(Completion(tokens, logprobs, finish, version, c.get("text") or ""))
    return out
