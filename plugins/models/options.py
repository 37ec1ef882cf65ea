"""Options of the backends registered in forgerl_plugins.models (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TinyModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    architecture: str = Field("qwen2", pattern="^(qwen2|llama)$")
    hidden_size: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    vocab_size: int = Field(512, ge=300)
    seed: int = 0


class SmolLM2Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
