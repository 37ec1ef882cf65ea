"""The Countdown game: problems and their checker (no eval(): a small AST walker).

Each backend is one class: its name, description and options model live on it; the
registration module (plugin.py) names the classes as "module:Class". This module is
imported when the registry is built, so it imports nothing heavier than pydantic.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgerl.interfaces import Reward, Task
from forgerl.types import Problem, RewardInput, RewardResult

_EVAL_SEED = 1_234_567  # the held-out split is the same for every run seed


class CountdownTask(Task):
    name = "countdown"
    description = "reach a target number from given numbers"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        numbers: int = Field(3, ge=2, le=6, description="How many numbers each problem gives.")
        max_number: int = Field(25, ge=2)
        eval_size: int = Field(32, ge=1)

    def __init__(self, options: Options, *, seed: int):
        self.options = options
        self.seed = seed
        self.position = 0
        self._eval = [self._problem(random.Random(_EVAL_SEED + i), f"eval-{i}") for i in range(options.eval_size)]
        self._eval_keys = {(p.metadata["numbers"], p.answer) for p in self._eval}

    def _problem(self, rng: random.Random, pid: str) -> Problem:
        nums = [rng.randint(1, self.options.max_number) for _ in range(self.options.numbers)]
        # The target is reachable by construction: combine the numbers left to right.
        target = nums[0]
        for n in nums[1:]:
            target = target + n if rng.random() < 0.6 or target <= n else target - n
        text = (
            f"Using the numbers {nums}, write an arithmetic expression that equals {target}. "
            "Use each number at most once and only + - * / and parentheses. "
            "Give the expression inside <answer></answer>."
        )
        return Problem(
            id=pid,
            prompt=[{"role": "user", "content": text}],
            answer=str(target),
            metadata={"numbers": tuple(nums)},
        )

    def next_problems(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            rng = random.Random(self.seed * 1_000_003 + self.position)
            p = self._problem(rng, f"train-{self.position}")
            self.position += 1
            if (p.metadata["numbers"], p.answer) not in self._eval_keys:
                out.append(p)
        return out

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


class CountdownReward(Reward):
    name = "countdown"
    description = "checks a Countdown expression"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        well_formed_credit: float = Field(0.1, ge=0, le=1)

    def __init__(self, options: Options):
        self.options = options

    def score(self, sample: RewardInput) -> RewardResult:
        found = re.findall(r"<answer>(.*?)</answer>", sample.completion_text, flags=re.DOTALL)
        if not found:
            return RewardResult(0.0, {"correct": 0.0})
        try:
            value, used = evaluate(found[-1].strip())
        except ValueError:
            return RewardResult(0.0, {"correct": 0.0})
        allowed = Counter(sample.problem.metadata["numbers"])
        ok = not (Counter(used) - allowed) and value == Fraction(int(sample.problem.answer))
        credit = 1.0 if ok else self.options.well_formed_credit
        return RewardResult(credit, {"correct": float(ok)})


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Value of an expression of integers, + - * / and parentheses, and the integers used.
    Anything else raises ValueError."""
    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(str(exc)) from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ValueError("division by zero")
                return left / right
            op = _OPS.get(type(node.op))
            if op is None:
                raise ValueError(f"operator {type(node.op).__name__} not allowed")
            return op(left, right)
        raise ValueError(f"{type(node).__name__} not allowed")

    return walk(tree), used
