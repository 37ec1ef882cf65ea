"""Registration: one task and one reward, both named ``countdown``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import RewardBackend, TaskBackend
from forgerl.hookspecs import hookimpl


class CountdownTaskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numbers: int = Field(3, ge=2, le=6, description="How many numbers each problem gives.")
    max_number: int = Field(25, ge=2)
    eval_size: int = Field(32, ge=1)


class CountdownRewardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    well_formed_credit: float = Field(0.1, ge=0, le=1)


@hookimpl
def forge_tasks():
    return [
        TaskBackend(
            name="countdown",
            factory="forgerl_countdown.game:CountdownTask",
            options=CountdownTaskOptions,
            description="reach a target number from given numbers",
        )
    ]


@hookimpl
def forge_rewards():
    return [
        RewardBackend(
            name="countdown",
            factory="forgerl_countdown.game:CountdownReward",
            options=CountdownRewardOptions,
            description="checks a Countdown expression",
        )
    ]
