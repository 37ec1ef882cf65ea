"""Built-in rewards: ``math_answer``, ``format``, ``code``, ``remote``, ``reward_model``."""

from __future__ import annotations

from forgerl.backends import RewardBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_rewards():
    return [
        RewardBackend(
            name="math_answer",
            factory="forgerl_plugins.rewards.math_answer:MathAnswerReward",
            options="forgerl_plugins.rewards.options:MathAnswerOptions",
            description="the answer equals the reference (math-verify)",
            requires=("math_verify",),
        ),
        RewardBackend(
            name="format",
            factory="forgerl_plugins.rewards.format:FormatReward",
            options="forgerl_plugins.rewards.options:FormatOptions",
            description="the completion matches a regular expression",
        ),
        RewardBackend(
            name="code",
            factory="forgerl_plugins.rewards.code:CodeReward",
            options="forgerl_plugins.rewards.options:CodeOptions",
            description="the completion's program passes the problem's tests (sandboxed)",
            preflight="forgerl_plugins.rewards.code:preflight",
        ),
        RewardBackend(
            name="remote",
            factory="forgerl_plugins.rewards.remote:RemoteReward",
            options="forgerl_plugins.rewards.options:RemoteOptions",
            description="an HTTP scoring service scores each sample",
            local_preflight="forgerl_plugins.rewards.remote:local_preflight",
        ),
        RewardBackend(
            name="reward_model",
            factory="forgerl_plugins.rewards.reward_model:RewardModelReward",
            options="forgerl_plugins.rewards.options:RewardModelOptions",
            roles="forgerl_plugins.rewards.reward_server:roles",
            local_preflight="forgerl_plugins.rewards.reward_model_client:local_preflight",
            description="a Hugging Face sequence-classification model scores each sample "
            "(in-process, or served by vLLM)",
            requires=("torch", "transformers"),
        ),
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(
    __name__, ("MathAnswerOptions", "FormatOptions", "CodeOptions", "RemoteOptions", "RewardModelOptions")
)
