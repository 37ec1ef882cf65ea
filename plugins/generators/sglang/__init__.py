"""``sglang``: SGLang servers."""

from __future__ import annotations

from forgerl.backends import GeneratorBackend
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


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "SGLangGeneratorOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
