"""Registration: a task and an environment, both named ``units``.

Each hook names its backend's class as "module:Class"; the registry imports
:mod:`forgerl_units.units` when it is built (it imports nothing heavier than pydantic).
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl

#: The forgerl plugin API this plugin is written for (docs/plugins.md, "API stability and versions").
FORGERL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def forge_tasks():
    return ["forgerl_units.units:UnitsTask"]


@hookimpl
def forge_environments():
    return ["forgerl_units.units:UnitsEnvironment"]
