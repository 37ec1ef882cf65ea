"""Registration: one task and one reward, both named ``reasoning_gym``.

The registry imports :mod:`forgerl_reasoning_gym.gym` when it is built; that module imports
reasoning-gym (slow: it loads every generator) only when a task or reward is made.
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl

#: The forgerl plugin API this plugin is written for (docs/plugins.md, "API stability and versions").
FORGERL_PLUGIN_API = ">=1.0,<2"


@hookimpl
def forge_tasks():
    return ["forgerl_reasoning_gym.gym:ReasoningGymTask"]


@hookimpl
def forge_rewards():
    return ["forgerl_reasoning_gym.gym:ReasoningGymReward"]
