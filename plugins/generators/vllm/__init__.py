"""``vllm``: vLLM's OpenAI-compatible servers, many replicas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl


class VLLMGeneratorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=1)
    kv_cache_gb: float | None = Field(None, gt=0)
    enforce_eager: bool = True
    max_concurrency: int = Field(64, ge=1)
    update_policy: str = Field("wait", pattern="^(wait|abort)$")
    startup_timeout: float = Field(300.0, gt=0)
    engine_args: dict[str, Any] = Field(default_factory=dict)


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="vllm",
            factory=None,
            options=VLLMGeneratorOptions,
            description="vLLM OpenAI-compatible servers (replicas, weight updates, failover)",
            requires=("vllm",),
            extra="vllm",
            implemented=False,
        )
    ]
