"""``hf``: in-process generation with transformers (reference backend, small tests)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return ["forgerl_plugins.generators.hf.generator:HFGenerator"]
