"""The ``arithmetic`` task: generated integer problems such as "What is 17 + 25?".

Problem ``i`` of the training stream is drawn from an RNG seeded with ``(seed, i)``, so
the stream is deterministic and its state is one integer: a resumed run continues with
exactly the problems it would have seen. The held-out split is drawn from a fixed seed
(independent of the run seed, so evaluations of different runs compare) and its problems
never appear in the training stream.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from forgerl.errors import ConfigError
from forgerl.interfaces import Task
from forgerl.options import OptionsModel
from forgerl.types import Problem

ARITHMETIC_OPERATIONS = ("+", "-", "*")

#: Seeds the held-out split; fixed so that every run evaluates on the same problems.
EVAL_SEED = 20250101

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Key = tuple[int, str, int]


class ArithmeticTask(Task):
    name = "arithmetic"
    description = "generated integer problems, answer in a tag"

    class Options(OptionsModel):
        min_value: int = Field(1, ge=0, le=10**9, description="Smallest operand.")
        max_value: int = Field(20, ge=1, le=10**9, description="Largest operand (at most 10^9).")
        operations: list[str] = Field(
            default_factory=lambda: ["+"], min_length=1, description="Operations to draw from: +, -, *."
        )
        allow_negative: bool = Field(
            False, description="Allow negative results of '-' (otherwise the larger operand comes first)."
        )
        eval_size: int = Field(
            64,
            ge=1,
            le=1_000_000,
            description="Held-out problems (the same for every run seed), at most 10^6.",
        )
        tag: str = Field(
            "answer", pattern=r"^[A-Za-z_][\w-]*$", description="The prompt asks for <tag></tag>."
        )

        @field_validator("operations")
        @classmethod
        def _known_operations(cls, ops: list[str]) -> list[str]:
            unknown = [op for op in ops if op not in ARITHMETIC_OPERATIONS]
            if unknown:
                raise ValueError(f"unknown operations {unknown}; choose from {list(ARITHMETIC_OPERATIONS)}")
            return list(dict.fromkeys(ops))  # drop duplicates, keep order

        @model_validator(mode="after")
        def _range(self) -> ArithmeticTask.Options:
            if self.min_value > self.max_value:
                raise ValueError(f"min_value ({self.min_value}) must not exceed max_value ({self.max_value})")
            return self

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        self.position = 0
        space = self.space_size()
        # Rejection sampling of training problems needs most of the space left free; a
        # held-out split covering half of it or more also leaves too little to learn from.
        if 2 * options.eval_size > space:
            raise ConfigError(
                f"task arithmetic: operands {options.min_value}..{options.max_value} with "
                f"{options.operations} give only {space} distinct problems; eval_size "
                f"({options.eval_size}) may be at most {space // 2}. Widen the range or lower eval_size."
            )
        self._eval_keys = self._draw_eval_keys()
        self._eval_set = set(self._eval_keys)
        self._eval = [self._problem(key, f"arithmetic/eval/{j}") for j, key in enumerate(self._eval_keys)]

    # ------------------------------------------------------------------ Task

    def next_problems(self, n: int) -> list[Problem]:
        problems = [self.problem_at(self.position + k) for k in range(n)]
        self.position += n
        return problems

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "seed" in state and int(state["seed"]) != self.seed:
            # The position means nothing in another seed's stream.
            raise ConfigError(
                f"task arithmetic: the saved state is for seed {state['seed']}, "
                f"this run uses seed {self.seed}"
            )
        self.position = int(state["position"])

    def demonstration(self, problem: Problem) -> str | None:
        """A worked answer (for supervised fine-tuning): the sum written out, then the
        result inside the tag the prompt asks for."""
        meta = problem.metadata
        if not {"a", "op", "b"} <= set(meta):
            return None
        tag = self.options.tag
        return f"{meta['a']} {meta['op']} {meta['b']} = {problem.answer}, so the answer is <{tag}>{problem.answer}</{tag}>."

    # ------------------------------------------------------------- problems

    def problem_at(self, index: int) -> Problem:
        """Training problem ``index`` of this seed's stream (the same every call)."""
        rng = random.Random(f"arithmetic:{self.seed}:{index}")
        while True:
            key = self._draw(rng)
            if key not in self._eval_set:
                return self._problem(key, f"arithmetic/{index}")

    def space_size(self) -> int:
        n = self.options.max_value - self.options.min_value + 1
        total = 0
        for op in self.options.operations:
            total += n * (n + 1) // 2 if op == "-" and not self.options.allow_negative else n * n
        return total

    def _draw(self, rng: random.Random) -> Key:
        o = self.options
        op = rng.choice(o.operations)
        a = rng.randint(o.min_value, o.max_value)
        b = rng.randint(o.min_value, o.max_value)
        if op == "-" and not o.allow_negative and a < b:
            a, b = b, a
        return (a, op, b)

    def _draw_eval_keys(self) -> list[Key]:
        rng = random.Random(f"arithmetic:eval:{EVAL_SEED}")
        keys: dict[Key, None] = {}  # ordered set
        while len(keys) < self.options.eval_size:
            keys[self._draw(rng)] = None
        return list(keys)

    def _problem(self, key: Key, problem_id: str) -> Problem:
        a, op, b = key
        tag = self.options.tag
        prompt = f"What is {a} {op} {b}? Think briefly, then give the final answer inside <{tag}></{tag}>."
        return Problem(
            id=problem_id,
            prompt=[{"role": "user", "content": prompt}],
            answer=str(_APPLY[op](a, b)),
            # answer_type tells math_answer to accept a number, not an expression such
            # as "17 + 25" that merely restates the question.
            metadata={"a": a, "b": b, "op": op, "answer_type": "integer"},
        )
