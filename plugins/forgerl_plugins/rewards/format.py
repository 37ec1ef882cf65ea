"""The ``format`` reward: 1.0 when the completion matches a regular expression, else 0.0.

Used beside ``math_answer`` with a small weight, it rewards writing the answer in the
requested tag before the answer is right, which gives a weak model a signal to follow.
``.`` matches newlines (DOTALL): completions span lines.
"""

from __future__ import annotations

import re

from forgerl.interfaces import Reward
from forgerl.types import RewardInput
from forgerl_plugins.rewards import FormatOptions


class FormatReward(Reward):
    def __init__(self, options: FormatOptions):
        self.options = options
        regex = re.compile(options.pattern, re.DOTALL)
        self._match = regex.fullmatch if options.mode == "fullmatch" else regex.search

    def score(self, sample: RewardInput) -> float:
        return 1.0 if self._match(sample.completion_text) else 0.0
