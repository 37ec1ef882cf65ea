"""Options of the backends registered in forgerl_plugins.generators.sglang (imported only when validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SGLangGeneratorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
