"""``hf``: in-process generation with transformers (reference backend, small tests)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl


class HFGeneratorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(16, ge=1, description="Sequences generated together in one forward pass.")
    dtype: str | None = Field(None, description="Override the model dtype for generation (float32, bfloat16).")


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="hf",
            factory="forgerl_plugins.generators.hf.generator:HFGenerator",
            options=HFGeneratorOptions,
            description="transformers generate, in the trainer's process",
            requires=("torch", "transformers"),
        )
    ]
