"""The session's shared vLLM server (tests/helpers/shared_vllm.py) is handed to OpenAI
clients serving the model folder's weights, whatever weights a ``vllm`` generator loaded
into it before: the tests sharing it do not depend on their order."""

from __future__ import annotations

import importlib.util

import pytest

from forgerl.testing.generator_support import logprob_gap, push
from forgerl.types import Completion

from ..helpers.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def greedy(base_url: str, api_key: str, prompt: list[int]) -> Completion:
    """A greedy completion with its tokens' logprobs, asked over the plain OpenAI API."""
    import httpx

    from forgerl_plugins.generators.vllm.server import SERVED_MODEL_NAME

    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(
        base_url + "/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=scaled(60)
    )
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return Completion(token_ids=tokens, logprobs=choice["logprobs"]["token_logprobs"], finish_reason="length", policy_version=0)


def test_the_openai_endpoint_serves_the_folders_weights_after_an_update(shared_vllm):
    site = shared_vllm.site()
    prompt = site.random_prompt(7, 16)
    changed = site.new_weights(5)
    with site.open() as opened:
        push(opened, 5, changed, scaled(60))
    endpoint = shared_vllm.openai_endpoint()
    assert endpoint.model_dir == site.model_dir
    completion = greedy(endpoint.base_url, endpoint.api_key, prompt)
    assert logprob_gap(site.reference(), prompt, completion, 1.0) <= 1e-4
    # ... which version 5's are not (the check above tells them apart).
    assert logprob_gap(site.reference(changed), prompt, completion, 1.0) > 1e-3
    site.reference()
