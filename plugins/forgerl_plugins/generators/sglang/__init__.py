"""``sglang``: SGLang servers, many replicas.

The scheduler starts ``replicas`` launchers (:meth:`.generator.SGLangGenerator.roles`),
each running ``python -m sglang.launch_server`` beside the trainer; trainer rank 0 talks to
them over HTTP (:mod:`.generator`) and has them load new weights through the run's
transport, as engine-owned receivers (SGLang receives the bytes itself).
:class:`.generator.SGLangGenerator` holds the backend's name, options and roles; nothing it
imports at its top level imports SGLang or httpx.
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl

#: The SGLang release whose HTTP API this plugin was written against (constraints pin it).
SGLANG_VERSION = "0.5.23"


@hookimpl
def forge_generators():
    return ["forgerl_plugins.generators.sglang.generator:SGLangGenerator"]
