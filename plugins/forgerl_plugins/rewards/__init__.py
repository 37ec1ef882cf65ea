"""Built-in rewards: ``math_answer``, ``format``, ``code``, ``remote``, ``reward_model``;
and the distillation teacher ``model`` (:mod:`forgerl_plugins.teachers`), a per-token
signal served like the reward model."""

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


@hookimpl
def forge_teachers():
    return ["forgerl_plugins.teachers.model:ModelTeacher"]
