"""Registration: one task and one reward, both named ``countdown``.

Each hook names its backend's class as "module:Class"; the registry imports
:mod:`forgerl_countdown.game` when it is built (it imports nothing heavier than pydantic).
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl

#: The forgerl plugin API this plugin is written for (docs/plugins.md, "API stability and versions").
FORGERL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def forge_tasks():
    return ["forgerl_countdown.game:CountdownTask"]


@hookimpl
def forge_rewards():
    return ["forgerl_countdown.game:CountdownReward"]
