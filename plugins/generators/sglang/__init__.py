"""``sglang``: SGLang servers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl


class SGLangGeneratorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="sglang",
            factory=None,
            options=SGLangGeneratorOptions,
            description="SGLang servers",
            requires=("sglang",),
            extra="sglang",
            implemented=False,
        )
    ]
