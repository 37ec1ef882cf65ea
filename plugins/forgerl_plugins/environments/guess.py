"""The ``guess`` environment: a number-guessing game with feedback. The environment thinks
of an integer (fixed per problem, so a GRPO group plays one game); the model guesses, the
environment says "higher" or "lower"; reward 1 for the right number within
``max_guesses`` turns (0 after that). The run's task supplies only the problems' ids.

Besides ``correct`` and ``guesses``, the components say how the game was played:
``first_guess`` (1 when the first guess was right: the share of wins that needed the
feedback is ``1 - first_guess / correct``), ``hints`` (higher/lower hints the model
answered with another number) and ``followed`` (how many of those answers went the way
the hint said): ``followed / hints`` is how often the model used the feedback."""

from __future__ import annotations

import hashlib
import re

from pydantic import Field, model_validator

from forgerl.environment import Environment, Message, Step
from forgerl.options import OptionsModel
from forgerl.types import Problem


class GuessEnvironment(Environment):
    """guess a secret integer with higher/lower feedback; reward 1 when found"""

    name = "guess"
    scores = True

    class Options(OptionsModel):
        low: int = Field(1, ge=-(10**9), le=10**9, description="Smallest possible secret.")
        high: int = Field(16, ge=-(10**9), le=10**9, description="Largest possible secret.")
        max_guesses: int = Field(5, ge=1, le=100, description="Guesses before the game is lost.")

        @model_validator(mode="after")
        def _range(self) -> GuessEnvironment.Options:
            if self.high < self.low:
                raise ValueError(f"high ({self.high}) must be at least low ({self.low})")
            return self

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()
        self.secret = self.options.low
        self.guesses = 0
        self.hint: tuple[int, str] | None = None  # the last higher/lower hint: (its guess, "Higher."/"Lower.")
        self.hints = 0
        self.followed = 0

    def reset(self, problem: Problem) -> list[Message]:
        lo, hi = self.options.low, self.options.high
        digest = int(hashlib.sha256(problem.id.encode()).hexdigest(), 16)
        self.secret = lo + digest % (hi - lo + 1)
        return [
            {"role": "system", "content": f"I am thinking of an integer from {lo} to {hi}. Find it. "
             "Answer each turn with one number; I will say higher or lower."},
            {"role": "user", "content": "Your first guess?"},
        ]

    def step(self, assistant_text: str) -> Step:
        self.guesses += 1
        numbers = re.findall(r"-?\d+", assistant_text)
        guess = int(numbers[-1]) if numbers and len(numbers[-1]) < 12 else None
        if guess is not None and self.hint is not None:
            before, said = self.hint
            self.hints += 1
            self.followed += guess > before if said == "Higher." else guess < before
        if guess == self.secret or self.guesses >= self.options.max_guesses:
            return self._finish(guess == self.secret)
        if guess is None:
            hint = f"Answer with one integer from {self.options.low} to {self.options.high}."
            self.hint = None
        else:
            hint = "Higher." if guess < self.secret else "Lower."
            self.hint = (guess, hint)
        return Step.observe({"role": "user", "content": hint})

    def _finish(self, won: bool) -> Step:
        return Step.finish(
            float(won), correct=float(won), guesses=float(self.guesses),
            first_guess=float(won and self.guesses == 1), hints=float(self.hints), followed=float(self.followed),
        )
