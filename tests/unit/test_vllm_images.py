"""The vllm generator's image requests without a server: the tokens-in body (our unexpanded
ids and the images, lossless), the check that vLLM's expansion equals the processor's, and
one-line refusals. Under 1 s (Pillow, httpx)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PIL")
httpx = pytest.importorskip("httpx")

from forgerl.errors import GeneratorError  # noqa: E402
from forgerl.images import ImageLimits  # noqa: E402
from forgerl.images.loading import load_image  # noqa: E402
from forgerl.types import GenerationRequest, ImageInputs, SamplingParams  # noqa: E402
from forgerl_plugins.generators.common.replica import Replica  # noqa: E402
from forgerl_plugins.generators.vllm.images import (  # noqa: E402
    GENERATE_PATH,
    image_request_body,
    parse_image_completions,
)
from tests.helpers import images as im  # noqa: E402

EXPANDED = [1, 7, 3, 4, 4, 4, 4, 3, 9, 2]
UNEXPANDED = (1, 7, 4, 9, 2)


def _request(n: int = 2) -> GenerationRequest:
    image = load_image(im.data_url(im.png(13, 7, (1, 2, 3))), ImageLimits())
    images = ImageInputs(images=(image,), features={}, unexpanded_ids=UNEXPANDED)
    return GenerationRequest("r0", EXPANDED, n, SamplingParams(max_tokens=5, temperature=0.7, seed=3), images=images)


def _replica() -> Replica:
    return Replica(index=0, log=Path("/dev/null"), endpoint=Path("/dev/null"), model="m", max_model_len=64)


def test_the_body_sends_unexpanded_ids_and_lossless_images() -> None:
    body = image_request_body(_request(), _replica(), send_seed=True, placeholders={4})
    assert body["token_ids"] == list(UNEXPANDED)
    assert body["return_token_ids"] is True
    sp = body["sampling_params"]
    assert (sp["n"], sp["max_tokens"], sp["temperature"], sp["seed"], sp["logprobs"]) == (2, 5, 0.7, 3, 0)
    assert sp["stop_token_ids"] == [4], "a sampled placeholder ends the sequence"
    [part] = body["content_parts"]
    again = load_image(part["url"], ImageLimits())
    assert part["type"] == "image_url" and again.tobytes() == _request().images.images[0].tobytes()


def _response(prompt_ids: list[int], status: int = 200) -> httpx.Response:
    choice = {"index": 0, "finish_reason": "length", "token_ids": [5, 6], "text": "ab",
              "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]}}  # fmt: skip
    payload = {"prompt_token_ids": prompt_ids, "choices": [choice, {**choice, "index": 1}]}
    return httpx.Response(status, json=payload, request=httpx.Request("POST", "http://x" + GENERATE_PATH))


def test_completions_are_parsed_when_vllm_expanded_as_the_processor_did() -> None:
    out = parse_image_completions(_request(), _response(EXPANDED), version=3)
    assert [(c.token_ids, c.logprobs, c.policy_version, c.text) for c in out] == [([5, 6], [-0.5, -1.5], 3, "ab")] * 2


def test_another_expansion_fails_the_request_in_one_line() -> None:
    with pytest.raises(GeneratorError, match="not token-exact") as info:
        parse_image_completions(_request(), _response([1, 7, 3, 4, 4, 3, 9, 2]), version=0)
    assert "\n" not in str(info.value)


def test_a_server_without_the_endpoint_is_named() -> None:
    with pytest.raises(GeneratorError, match="--enable-scale-out"):
        parse_image_completions(_request(), _response(EXPANDED, status=404), version=0)
