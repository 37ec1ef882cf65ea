"""The ``openai`` generator passes forgerl's Generator kit (forgerl.testing) against a real
OpenAI-compatible server: vLLM serving the kit's tiny model (hidden size 128: vLLM's CPU
attention needs heads at least 32 wide), started once for the class."""

from __future__ import annotations

import importlib.util

import pytest
from openai_server import vllm_openai_server

from forgerl.testing import GeneratorContract
from forgerl.testing.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

SERVER_WAIT_S = 420.0  # a vLLM server's start-up on a busy two-core machine


class TestOpenAIGenerator(GeneratorContract):
    backend = "openai"
    plugins = ("forgerl_openai_compat.plugin",)
    tiny_model_options = {"hidden_size": 128}

    @pytest.fixture(scope="class")
    @classmethod
    def generator_options(cls, generator_model, tmp_path_factory):
        log = tmp_path_factory.mktemp("vllm") / "server.log"
        with vllm_openai_server(generator_model, log, scaled(SERVER_WAIT_S)) as base_url:
            yield {"base_url": base_url, "request_timeout": scaled(120)}
