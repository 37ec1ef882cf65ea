"""A :class:`~forgerl.types.GenerationRequest` as an OpenAI ``/v1/completions`` body, and the
answer as :class:`~forgerl.types.Completion` objects.

One request per prompt: ``n`` completions, the prompt as token ids (the OpenAI API takes a
list of integers), ``logprobs: 0`` (the sampled token's logprob, no alternatives).

Token ids come from the server, never from tokenizing the returned text: decoding is not
invertible (a byte-level BPE re-tokenizes ``" 42"`` as other tokens than were sampled, and
a completion cut mid-character has no text for its last bytes), so re-tokenized ids would
not be the tokens whose logprobs the server reported, and the loss would score other
tokens than were sampled. The body asks for ``return_tokens_as_token_ids`` (vLLM: each
``logprobs.tokens`` entry is then ``"token_id:<id>"``, aligned with ``token_logprobs``);
a ``token_ids`` list in the choice (vLLM's ``return_token_ids``, which ``extra_body`` can
ask for) is taken otherwise. A server that returns neither is refused with one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from forgerl.errors import GeneratorError
from forgerl.types import Completion, FinishReason, GenerationRequest

TOKEN_ID_PREFIX = "token_id:"
FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}


def request_body(
    request: GenerationRequest, model: str, *, send_seed: bool, extra: Mapping[str, Any]
) -> dict[str, Any]:
    prompt = [int(t) for t in request.prompt_token_ids]
    if not prompt:
        raise GeneratorError(f"request {request.request_id!r} has an empty prompt")
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        # Greedy completions are all the same (and vLLM refuses n > 1 at temperature 0).
        "n": request.n if s.temperature > 0 else 1,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k  # not OpenAI's, but vLLM's and SGLang's
    if s.stop:
        body["stop"] = list(s.stop)
    if send_seed and s.seed is not None:
        body["seed"] = int(s.seed)
    body.update(extra)
    return body


def parse_completions(request: GenerationRequest, data: Mapping[str, Any], version: int) -> list[Completion]:
    """The ``n`` completions of the server's answer ``data``, labelled with ``version``."""
    rid = request.request_id
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    if request.sampling.temperature <= 0 and len(choices) == 1:
        choices = choices * request.n
    if len(choices) != request.n:
        raise GeneratorError(
            f"request {rid!r}: asked for {request.n} completions, the server returned {len(choices)}"
        )
    out = []
    for c in choices:
        reason = FINISH.get(str(c.get("finish_reason")))
        if reason is None:
            raise GeneratorError(
                f"request {rid!r}: the server finished a completion with {c.get('finish_reason')!r}"
            )
        logprobs = c.get("logprobs") or {}
        values = logprobs.get("token_logprobs")
        if values is None:
            raise GeneratorError(
                f"request {rid!r}: the server returned no token logprobs (asked with logprobs: 0)"
            )
        ids = _token_ids(rid, logprobs.get("tokens"), c.get("token_ids"))
        if len(ids) != len(values):
            raise GeneratorError(
                f"request {rid!r}: the server returned {len(ids)} token ids but {len(values)} logprobs"
            )
        floats = [float(x) if isinstance(x, (int, float)) else math.nan for x in values]
        if not all(math.isfinite(x) for x in floats):
            raise GeneratorError(
                f"request {rid!r}: the server returned logprobs that are not numbers: {values[:5]}"
            )
        out.append(Completion(ids, floats, reason, version, c.get("text") or ""))
    return out


def _token_ids(rid: str, tokens: Any, token_ids: Any) -> list[int]:
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]
    if isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids):
        return list(token_ids)
    raise GeneratorError(
        f"request {rid!r}: the server returned the sampled tokens as text, not token ids: it must "
        "support return_tokens_as_token_ids (vLLM does) or return token_ids"
    )
