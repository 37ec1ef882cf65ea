"""Options of the ``countdown`` task and reward, imported only when options are validated:
the registration module (plugin.py) names them as "module:attr", so listing plugins
(`forge --help`, `forge plugins list`) never imports pydantic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CountdownTaskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numbers: int = Field(3, ge=2, le=6, description="How many numbers each problem gives.")
    max_number: int = Field(25, ge=2)
    eval_size: int = Field(32, ge=1)


class CountdownRewardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    well_formed_credit: float = Field(0.1, ge=0, le=1)
