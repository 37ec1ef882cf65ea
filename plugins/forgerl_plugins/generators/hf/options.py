"""Options of the backends registered in forgerl_plugins.generators.hf (imported only when validated)."""

from __future__ import annotations

from pydantic import Field

from forgerl.options import OptionsModel


class HFGeneratorOptions(OptionsModel):
    batch_size: int = Field(16, ge=1, le=65_536, description="Sequences generated together in one forward pass.")
    dtype: str | None = Field(
        None,
        pattern="^(float32|bfloat16|float16)$",
        description="Override the model dtype for generation (default: model.dtype of the run).",
    )
    device: str | None = Field(
        None, description="torch device to generate on (default: cuda when available, else cpu)."
    )
