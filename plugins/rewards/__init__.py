"""Built-in rewards: ``math_answer``, ``format``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import RewardBackend
from forgerl.hookspecs import hookimpl


class MathAnswerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tag: str | None = Field("answer", description="Read the answer inside <tag></tag>; None: the whole text.")
    fallback_last_number: bool = Field(
        True, description="Without a tagged answer, compare the last number in the text."
    )
    fallback_credit: float = Field(
        0.5, ge=0, le=1, description="Credit for a right answer found only by the fallback."
    )


class FormatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str = Field(r"<answer>.*?</answer>", description="Regular expression the completion should match.")
    mode: str = Field("search", pattern="^(search|fullmatch)$")


@hookimpl
def forge_rewards():
    return [
        RewardBackend(
            name="math_answer",
            factory="forgerl_plugins.rewards.math_answer:MathAnswerReward",
            options=MathAnswerOptions,
            description="the answer equals the reference (math-verify)",
            requires=("math_verify",),
        ),
        RewardBackend(
            name="format",
            factory="forgerl_plugins.rewards.format:FormatReward",
            options=FormatOptions,
            description="the completion matches a regular expression",
        ),
    ]
