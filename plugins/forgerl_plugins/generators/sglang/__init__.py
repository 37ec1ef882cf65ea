"""``sglang``: SGLang servers."""

from __future__ import annotations

from forgerl.backends import GeneratorBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="sglang",
            factory=None,
            options="forgerl_plugins.generators.sglang.options:SGLangGeneratorOptions",
            description="SGLang servers",
            requires=("sglang",),
            extra="sglang",
            implemented=False,
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("SGLangGeneratorOptions",))
