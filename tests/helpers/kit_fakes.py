"""A plugin of deliberately broken rewards and tasks, each breaking one rule the kits of
:mod:`forgerl.testing` check: the tests of the kits show that each check can fail.

Loaded by import path (``plugins = ("tests.helpers.kit_fakes",)``), so that reward worker
processes find these backends too. Each backend is one class holding its name, except
``kit_not_a_reward``: a record, because the registry refuses a class that is not a Reward
before the kit could, and the kit's own check is what this fake shows failing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from forgerl.backends import RewardBackend
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward, Task
from forgerl.types import Problem, RewardInput, RewardResult


class GoodReward(Reward):
    """1.0 when the completion contains the reference answer."""

    name = "kit_good"

    def __init__(self, options: Any):
        self.options = options

    def score(self, sample: RewardInput) -> float:
        return float(bool(sample.problem.answer) and sample.problem.answer in sample.completion_text)


class NanOnEmpty(GoodReward):
    name = "kit_nan_on_empty"

    def score(self, sample: RewardInput) -> float:
        return float("nan") if not sample.completion_text else super().score(sample)


class RaisesOnSurrogates(GoodReward):
    name = "kit_raises_on_surrogates"

    def score(self, sample: RewardInput) -> float:
        sample.completion_text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
        return super().score(sample)


class ReturnsText(GoodReward):
    name = "kit_returns_text"

    def score(self, sample: RewardInput) -> Any:
        return "1.0"


class InfiniteComponent(GoodReward):
    name = "kit_infinite_component"

    def score(self, sample: RewardInput) -> RewardResult:
        return RewardResult(super().score(sample), {"length": float("inf")})


class Random(GoodReward):
    name = "kit_random"

    def score(self, sample: RewardInput) -> float:
        return random.random()


class AsyncDisagrees(GoodReward):
    name = "kit_async_disagrees"

    async def ascore(self, sample: RewardInput) -> float:
        return 1.0 - self.score(sample)


class OnlyInThisProcess(GoodReward):
    """Scores 1.0 here, fails in a worker process: it reads state the worker lacks."""

    name = "kit_only_in_this_process"

    here: dict[str, float] = {}

    def score(self, sample: RewardInput) -> float:
        return self.here["value"]


class NotAReward:
    def __init__(self, options: Any):
        pass

    def score(self, sample: RewardInput) -> float:
        return 0.0


class GoodTask(Task):
    """Problem i of the stream is "What is i + seed?"."""

    name = "kit_good"

    def __init__(self, options: Any, *, seed: int):
        self.seed = seed
        self.position = 0

    def problem(self, i: int) -> Problem:
        return Problem(id=f"p{i}", prompt=f"What is {i} + {self.seed}?", answer=str(i + self.seed))

    def next_problems(self, n: int) -> list[Problem]:
        out = [self.problem(self.position + k) for k in range(n)]
        self.position += n
        return out

    def eval_problems(self) -> list[Problem]:
        return [Problem(id=f"e{i}", prompt=f"What is {i} + 1000?", answer=str(i + 1000)) for i in range(4)]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])

    def demonstration(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"


class ShortBatches(GoodTask):
    name = "kit_short_batches"

    def next_problems(self, n: int) -> list[Problem]:
        return super().next_problems(min(n, 100))  # stops at the end of its data instead of cycling


class EmptyChatMessage(GoodTask):
    name = "kit_empty_chat_message"

    def problem(self, i: int) -> Problem:
        return Problem(id=f"p{i}", prompt=[{"role": "user"}], answer="1")


class NumberAnswer(GoodTask):
    name = "kit_number_answer"

    def problem(self, i: int) -> Problem:
        return Problem(id=f"p{i}", prompt="What is 1?", answer=1)  # type: ignore[arg-type]


class Unpicklable(GoodTask):
    name = "kit_unpicklable"

    def problem(self, i: int) -> Problem:
        return Problem(id=f"p{i}", prompt="What is 1?", answer="1", metadata={"check": lambda x: x})


class RotatingEval(GoodTask):
    """Each call starts the held-out list one problem later."""

    name = "kit_rotating_eval"

    calls = 0

    def eval_problems(self) -> list[Problem]:
        problems = super().eval_problems()
        self.calls += 1
        return problems[self.calls % 4 :] + problems[: self.calls % 4]


class Unseeded(GoodTask):
    name = "kit_unseeded"

    def __init__(self, options: Any, *, seed: int):
        super().__init__(options, seed=seed)
        self.seed = random.randrange(10**9)


class ForgetsPosition(GoodTask):
    name = "kit_forgets_position"

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class StateNotJson(GoodTask):
    name = "kit_state_not_json"

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "rng": random.Random(1)}


class StateDictDraws(GoodTask):
    name = "kit_state_dict_draws"

    def state_dict(self) -> dict[str, Any]:
        self.position += 1
        return {"position": self.position}


class AnswersOutOfTurn(GoodTask):
    """Its demonstrations answer a tool call nobody made."""

    name = "kit_answers_out_of_turn"

    def problem(self, i: int) -> Problem:
        return Problem(id=f"p{i}", prompt=[{"role": "user", "content": f"What is {i} + 1?"}], answer=str(i + 1))

    def demonstration(self, problem: Problem) -> list[dict[str, str]]:  # type: ignore[override]
        return [{"role": "tool", "content": problem.answer}, {"role": "assistant", "content": problem.answer}]


class NeverDemonstrates(GoodTask):
    name = "kit_never_demonstrates"

    def demonstration(self, problem: Problem) -> None:  # type: ignore[override]
        return None


_REWARDS = (
    GoodReward,
    NanOnEmpty,
    RaisesOnSurrogates,
    ReturnsText,
    InfiniteComponent,
    Random,
    AsyncDisagrees,
    OnlyInThisProcess,
)

_TASKS = (
    GoodTask,
    ShortBatches,
    EmptyChatMessage,
    NumberAnswer,
    Unpicklable,
    RotatingEval,
    Unseeded,
    ForgetsPosition,
    StateNotJson,
    StateDictDraws,
    AnswersOutOfTurn,
    NeverDemonstrates,
)


@hookimpl
def forge_rewards():
    return [*_REWARDS, RewardBackend(name="kit_not_a_reward", factory=NotAReward)]


@hookimpl
def forge_tasks():
    return list(_TASKS)
