"""``sglang``: SGLang servers, many replicas.

The scheduler starts ``replicas`` launchers (:func:`forgerl_plugins.generators.sglang.server.roles`),
each running ``python -m sglang.launch_server`` beside the trainer; trainer rank 0 talks to
them over HTTP (:mod:`.generator`) and has them load new weights through the run's
transport, as engine-owned receivers (SGLang receives the bytes itself). Nothing here
imports SGLang, httpx or pydantic.
"""

from __future__ import annotations

from forgerl.backends import GeneratorBackend, lazy_options
from forgerl.hookspecs import hookimpl

#: The SGLang release whose HTTP API this plugin was written against (constraints pin it).
SGLANG_VERSION = "0.5.23"


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="sglang",
            factory="forgerl_plugins.generators.sglang.generator:SGLangGenerator",
            roles="forgerl_plugins.generators.sglang.server:roles",
            options="forgerl_plugins.generators.sglang.options:SGLangGeneratorOptions",
            description="SGLang servers (replicas, weight updates, failover; GPU only)",
            requires=("sglang",),
            extra="sglang",
            # SGLang has no CPU build: say so before anyone installs 11 GB for nothing.
            install_hint=f"pip install 'forgerl[sglang]' (SGLang {SGLANG_VERSION}; CUDA GPUs only)",
            info={"install": f"pip install 'forgerl[sglang]' (SGLang {SGLANG_VERSION}; CUDA GPUs only)"},
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("SGLangGeneratorOptions",))
