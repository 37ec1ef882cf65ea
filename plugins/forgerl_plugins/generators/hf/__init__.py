"""``hf``: in-process generation with transformers (reference backend, small tests)."""

from __future__ import annotations

from forgerl.backends import GeneratorBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="hf",
            factory="forgerl_plugins.generators.hf.generator:HFGenerator",
            options="forgerl_plugins.generators.hf.options:HFGeneratorOptions",
            description="transformers forward passes with a KV cache, in the trainer's process",
            requires=("torch", "transformers"),
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("HFGeneratorOptions",))
