"""Built-in rewards: ``math_answer``, ``format``, ``code``, ``remote``, ``reward_model``."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_rewards():
    return [
        "forgerl_plugins.rewards.math_answer:MathAnswerReward",
        "forgerl_plugins.rewards.format:FormatReward",
        "forgerl_plugins.rewards.code:CodeReward",
        "forgerl_plugins.rewards.remote:RemoteReward",
        "forgerl_plugins.rewards.reward_model:RewardModelReward",
    ]
