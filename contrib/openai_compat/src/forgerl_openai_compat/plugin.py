"""Registration: one generator, ``openai``. Imports neither pydantic nor httpx: the options
model and the generator are named as "module:attr" and imported when a run selects it."""

from __future__ import annotations

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="openai",
            factory="forgerl_openai_compat.generator:OpenAICompatGenerator",
            options="forgerl_openai_compat.options:OpenAICompatOptions",
            description="any OpenAI-compatible /v1/completions server with token logprobs (fixed weights)",
            requires=("httpx",),
            install_hint="pip install httpx",
        )
    ]
