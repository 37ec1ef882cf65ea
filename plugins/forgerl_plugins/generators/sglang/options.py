"""Options of the backends registered in forgerl_plugins.generators.sglang (imported only when validated)."""

from __future__ import annotations

from pydantic import Field

from forgerl.options import OptionsModel


class SGLangGeneratorOptions(OptionsModel):
    replicas: int = Field(1, ge=1, le=4096)
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
