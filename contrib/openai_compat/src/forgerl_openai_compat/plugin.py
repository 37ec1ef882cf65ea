"""Registration: one generator, ``openai``, named as "module:Class". Its class's module
imports pydantic but not httpx, which is imported only when the generator talks to a server."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl

#: The forgerl plugin API this plugin is written for (docs/plugins.md, "API stability and versions").
FORGERL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def forge_generators():
    return ["forgerl_openai_compat.generator:OpenAICompatGenerator"]
