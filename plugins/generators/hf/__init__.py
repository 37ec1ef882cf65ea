"""``hf``: in-process generation with transformers (reference backend, small tests)."""

from __future__ import annotations

from forgerl.backends import GeneratorBackend
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


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "HFGeneratorOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
