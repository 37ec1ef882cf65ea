"""The ``calculator`` environment: arithmetic problems (from the run's task, e.g.
``arithmetic``) with a ``calculate`` tool, for sums a small model cannot do in its head.

The model may call ``calculate`` any number of times (within ``environment.max_turns``);
its first turn without a tool call is its answer, scored 1 when the number inside
``<answer></answer>`` (or, without tags, its last number) equals the problem's answer.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from forgerl.environment import Environment, Message, Step, tool
from forgerl.options import OptionsModel
from forgerl.types import Problem

SYSTEM = (
    "You solve arithmetic problems. Use the calculate tool for any computation, then give the "
    "final answer inside <{tag}></{tag}>."
)


def question_of(problem: Problem) -> str:
    """The problem's question: the arithmetic task's operands where given, else its prompt."""
    meta = problem.metadata
    if {"a", "op", "b"} <= set(meta):
        return f"What is {meta['a']} {meta['op']} {meta['b']}?"
    if isinstance(problem.prompt, str):
        return problem.prompt
    users = [m["content"] for m in problem.prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class CalculatorEnvironment(Environment):
    """arithmetic with a calculate(expression) tool; reward 1 for the right answer"""

    name = "calculator"
    scores = True

    class Options(OptionsModel):
        tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]*$", description="The answer goes inside <tag></tag>.")
        tool_bonus: float = Field(
            0.0, ge=0, le=1, description="Added to a right answer's reward when the model used the tool."
        )

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()
        self.problem: Problem | None = None
        self.tool_calls = 0

    def reset(self, problem: Problem) -> list[Message]:
        self.problem = problem
        return [
            {"role": "system", "content": SYSTEM.format(tag=self.options.tag)},
            {"role": "user", "content": question_of(problem)},
        ]

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / ** and parentheses, e.g. "(17 + 25) * 3"
        """
        from forgerl_plugins.environments.safe_arithmetic import evaluate, format_value

        self.tool_calls += 1
        return format_value(evaluate(expression))

    def answer(self, assistant_text: str) -> Step:
        assert self.problem is not None, "answer before reset"
        correct, tagged = arithmetic_verdict(assistant_text, self.problem, self.options.tag)
        used = float(self.tool_calls > 0)
        reward = float(correct) * (1.0 + self.options.tool_bonus * used)
        return Step.finish(reward, correct=float(correct), used_tool=used, tagged=float(tagged))


def arithmetic_verdict(text: str, problem: Problem, tag: str) -> tuple[bool, bool]:
    """(right, tagged): whether the number inside the last ``<tag></tag>`` of ``text`` (or,
    without tags, its last number) equals the problem's answer, and whether it was tagged."""
    tagged = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", tagged[-1] if tagged else text)
    return bool(numbers) and _same_number(numbers[-1], problem.answer), bool(tagged)


def _same_number(given: str, expected: Any) -> bool:
    try:
        return float(given) == float(str(expected).strip())
    except ValueError:
        return False
