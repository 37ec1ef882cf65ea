"""The ``format`` reward: 1.0 when the completion matches a regular expression, else 0.0.

Used beside ``math_answer`` with a small weight, it rewards writing the answer in the
requested tag before the answer is right, which gives a weak model a signal to follow.
``.`` matches newlines (DOTALL): completions span lines.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput


class FormatReward(Reward):
    name = "format"
    description = "the completion matches a regular expression"

    class Options(OptionsModel):
        # Non-empty content: "<answer></answer>" alone must not earn the format reward.
        pattern: str = Field(
            r"<answer>\s*[^<\s][^<]*</answer>", description="Regular expression the completion should match."
        )
        mode: str = Field("search", pattern="^(search|fullmatch)$", description="re.search or re.fullmatch.")

        @field_validator("pattern")
        @classmethod
        def _compiles(cls, pattern: str) -> str:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
            return pattern

    def __init__(self, options: Options):
        self.options = options
        regex = re.compile(options.pattern, re.DOTALL)
        self._match = regex.fullmatch if options.mode == "fullmatch" else regex.search

    def score(self, sample: RewardInput) -> float:
        return 1.0 if self._match(sample.completion_text) else 0.0
