"""``hf``: in-process generation with transformers (reference backend, small tests)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl


class HFGeneratorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(16, ge=1, description="Sequences generated together in one forward pass.")
    dtype: str | None = Field(
        None,
        pattern="^(float32|bfloat16|float16)$",
        description="Override the model dtype for generation (default: model.dtype of the run).",
    )
    device: str | None = Field(
        None, description="torch device to generate on (default: cuda when available, else cpu)."
    )


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="hf",
            factory="forgerl_plugins.generators.hf.generator:HFGenerator",
            options=HFGeneratorOptions,
            description="transformers forward passes with a KV cache, in the trainer's process",
            requires=("torch", "transformers"),
        )
    ]
