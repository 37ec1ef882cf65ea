"""The ``openai`` generator passes forgerl's Generator kit (forgerl.testing) against a real
OpenAI-compatible server: vLLM serving the kit's tiny model (conftest.py's ``openai_server``)."""

from __future__ import annotations

import importlib.util

import pytest

from forgerl.testing import GeneratorContract
from forgerl.testing.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

KEY_ENV = "OPENAI_API_KEY"  # the generator's default api_key_env


class TestOpenAIGenerator(GeneratorContract):
    backend = "openai"
    plugins = ("forgerl_openai_compat.plugin",)

    @pytest.fixture(scope="class")
    @classmethod
    def generator_model(cls, openai_server):
        return openai_server.model_dir  # the weights the server serves: the kit's reference

    @pytest.fixture(scope="class")
    @classmethod
    def generator_options(cls, openai_server):
        # The generator reads its key from the environment when it is built, in this process.
        with pytest.MonkeyPatch.context() as env:
            if openai_server.api_key is None:
                env.delenv(KEY_ENV, raising=False)
            else:
                env.setenv(KEY_ENV, openai_server.api_key)
            yield {"base_url": openai_server.base_url, "request_timeout": scaled(120)}
