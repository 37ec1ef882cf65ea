"""A :class:`~forgerl.types.GenerationRequest` with images, through vLLM's tokens-in endpoint.

vLLM 0.32's ``/v1/completions`` takes no images, and ``/v1/chat/completions`` renders the
prompt itself (from messages, not our ids). ``/inference/v1/generate`` (on with
``--enable-scale-out``) takes our token ids, placeholders already expanded by the model's
processor, with the images as content parts; vLLM's processor finds the expanded
placeholders in the ids and computes the pixels from the same decoded images (re-encoded
as lossless PNG). The answer carries the prompt ids vLLM used: any difference from ours
fails the request, so token exactness is checked on every request, not assumed.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError
from forgerl.types import Completion, GenerationRequest
from forgerl_plugins.generators.common.client import error_message
from forgerl_plugins.generators.common.pool import ReplicaFailed
from forgerl_plugins.generators.common.replica import Replica

from .completions import FINISH, request_body

if TYPE_CHECKING:  # pragma: no cover
    import httpx

GENERATE_PATH = "/inference/v1/generate"
#: The server flag that registers GENERATE_PATH (vLLM 0.32).
SERVER_FLAG = "--enable-scale-out"


def png_data_url(image: Any) -> str:
    """A decoded image as a lossless PNG data URL: vLLM decodes the same pixels."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_request_body(
    request: GenerationRequest, r: Replica, *, send_seed: bool, placeholders: Collection[int]
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body of an image request (the completions body's
    checks and sampling, moved to ``sampling_params``)."""
    assert request.images is not None, "only requests with images take this path"
    completions = request_body(request, r, send_seed=send_seed)
    sampling: dict[str, Any] = {
        k: completions[k]
        for k in ("n", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "skip_special_tokens")
        if k in completions
    }
    sampling["logprobs"] = 0
    if placeholders:
        # A sampled image placeholder ends the sequence, as in the hf generator: the
        # trainer feeds it as a plain last token (docs/vision.md).
        sampling["stop_token_ids"] = sorted(placeholders)
    if not request.images.unexpanded_ids:
        raise GeneratorError(
            f"request {request.request_id!r}: its images lack the prompt's unexpanded ids, which vLLM expands itself"
        )
    return {
        "model": completions["model"],
        # vLLM expands the placeholders itself; the answer's prompt ids are checked against ours.
        "token_ids": list(request.images.unexpanded_ids),
        "content_parts": [{"type": "image_url", "url": png_data_url(i)} for i in request.images.images],
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "text",
    }


def parse_image_completions(request: GenerationRequest, resp: httpx.Response, version: int) -> list[Completion]:
    """As :func:`.completions.parse_completions`, for the generate endpoint's answer."""
    if resp.status_code >= 500 or resp.status_code in (401, 403):
        raise ReplicaFailed(f"HTTP {resp.status_code}: {error_message(resp)}")
    if resp.status_code == 404:
        raise GeneratorError(
            f"vLLM has no {GENERATE_PATH} (request {request.request_id!r}): images need the server "
            f"started with {SERVER_FLAG}, which forgerl adds for a vision-language model"
        )
    if resp.status_code != 200:
        raise GeneratorError(
            f"vLLM rejected request {request.request_id!r} with images (HTTP {resp.status_code}): {error_message(resp)}"
        )
    data = resp.json()
    ours = [int(t) for t in request.prompt_token_ids]
    theirs = data.get("prompt_token_ids")
    if theirs is None:
        raise GeneratorError(f"request {request.request_id!r}: vLLM did not return the prompt's token ids")
    if [int(t) for t in theirs] != ours:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise GeneratorError(
            f"request {request.request_id!r}: vLLM expanded the images into other prompt tokens than the "
            f"processor did ({len(theirs)} ids vs {len(ours)}, first difference at {first}): not token-exact"
        )
    choices = sorted(data["choices"], key=lambda c: c["index"])
    if any(c.get("finish_reason") == "abort" for c in choices):
        raise ReplicaFailed("the server aborted the request")
    if request.sampling.temperature <= 0 and len(choices) == 1:
        choices = choices * request.n
    if len(choices) != request.n:
        raise GeneratorError(f"request {request.request_id!r}: asked for {request.n} completions, got {len(choices)}")
    out = []
    for c in choices:
        tokens = [int(t) for t in c.get("token_ids") or []]
        logprobs = [float(x["logprob"]) for x in (c.get("logprobs") or {}).get("content") or []]
        if len(logprobs) != len(tokens):
            raise GeneratorError(
                f"request {request.request_id!r}: vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs"
            )
        finish = FINISH.get(str(c.get("finish_reason")), "stop")
        out.append(Completion(tokens, logprobs, finish, version, c.get("text") or ""))
    return out
