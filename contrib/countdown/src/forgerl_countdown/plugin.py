"""Registration: one task and one reward, both named ``countdown``.

What the entry point imports, so it stays light: the options models and the game are
named as "module:attr" and imported only when a backend is validated or built.
"""

from __future__ import annotations

from forgerl.backends import RewardBackend, TaskBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_tasks():
    return [
        TaskBackend(
            name="countdown",
            factory="forgerl_countdown.game:CountdownTask",
            options="forgerl_countdown.options:CountdownTaskOptions",
            description="reach a target number from given numbers",
        )
    ]


@hookimpl
def forge_rewards():
    return [
        RewardBackend(
            name="countdown",
            factory="forgerl_countdown.game:CountdownReward",
            options="forgerl_countdown.options:CountdownRewardOptions",
            description="checks a Countdown expression",
        )
    ]
