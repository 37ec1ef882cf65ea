"""A plugin of environments, each breaking one rule the Environment kit checks (and one that
breaks none): tests/unit/test_kit_environment_checks_fail.py shows that each check can
fail. Loaded by import path (``plugins = ("tests.helpers.kit_fake_environments",)``).

Each is a small game: the secret is the problem's answer; ``guess(number)`` is a tool that
says higher or lower; a turn without a tool call is the final answer, scored 1 when right.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
from typing import Any

from pydantic import BaseModel, field_serializer

from forgerl.backends import EnvironmentBackend
from forgerl.environment import Environment, Message, Step, tool
from forgerl.hookspecs import hookimpl
from forgerl.options import OptionsModel
from forgerl.types import Problem

#: Set to end the threads ``kit_env_leaks_thread`` leaves behind; processes to kill.
LEAK_STOP = threading.Event()
CHILDREN: list[subprocess.Popen] = []


class GoodEnvironment(Environment):
    """guess the problem's answer with a higher/lower tool"""

    name = "kit_env_good"
    scores = True

    class Options(OptionsModel):
        bonus: float = 0.0

    def __init__(self, options: Any) -> None:
        self.options = options
        self.secret = ""
        self.calls: list[int] = []

    def reset(self, problem: Problem) -> list[Message]:
        self.secret = str(problem.answer)
        return [{"role": "system", "content": "Find the number. Answer with it alone."},
                {"role": "user", "content": "Your answer?"}]  # fmt: skip

    @tool
    def guess(self, number: int) -> str:
        """Say whether the secret is higher or lower than a number.

        Args:
            number: your guess
        """
        self.calls.append(number)
        secret = int(self.secret) if self.secret.lstrip("-").isdigit() else 0
        return "right" if number == secret else ("higher" if number < secret else "lower")

    def answer(self, assistant_text: str) -> Step:
        numbers = re.findall(r"-?\d+", assistant_text)
        correct = float(bool(numbers) and numbers[-1] == self.secret)
        return Step.finish(correct + self.options.bonus * correct, correct=correct, calls=float(len(self.calls)))


def make_environment(options: Any) -> GoodEnvironment:
    return GoodEnvironment(options)


class OpenOptions(GoodEnvironment):
    name = "kit_env_open_options"

    class Options(BaseModel):  # unknown keys ignored: pydantic's default
        bonus: float = 0.0


class LossyOptions(GoodEnvironment):
    name = "kit_env_lossy_options"

    class Options(OptionsModel):
        bonus: float = 0.25

        @field_serializer("bonus")
        def _rounded(self, value: float) -> float:
            return round(value)


class BadResetRole(GoodEnvironment):
    name = "kit_env_bad_reset_role"

    def reset(self, problem: Problem) -> list[Message]:
        super().reset(problem)
        return [{"role": "function", "content": "Find the number."}]


class StepReturnsDict(GoodEnvironment):
    name = "kit_env_step_returns_dict"

    def step(self, assistant_text: str) -> Any:
        return {"done": True, "reward": 1.0}


class UndocumentedTool(GoodEnvironment):
    name = "kit_env_undocumented_tool"

    @tool
    def hint(self, digits: int) -> str:
        return self.secret[:digits]


class UntypedTool(GoodEnvironment):
    name = "kit_env_untyped_tool"

    @tool
    def hint(self, digits) -> str:  # type: ignore[no-untyped-def]
        """The first digits of the secret."""
        return self.secret[:digits]


class ScoresNone(GoodEnvironment):
    name = "kit_env_scores_none"

    def answer(self, assistant_text: str) -> Step:
        return Step.finish()


class NeverEnds(GoodEnvironment):
    name = "kit_env_never_ends"

    def answer(self, assistant_text: str) -> Step:
        return Step.observe({"role": "user", "content": "Try again."})


class ClassHistory(GoodEnvironment):
    name = "kit_env_class_history"
    history: list[str] = []  # the bug this fake shows: one list shared by every instance

    def reset(self, problem: Problem) -> list[Message]:
        self.history.append(problem.id)
        return super().reset(problem)


class MutatesOptions(GoodEnvironment):
    name = "kit_env_mutates_options"

    def reset(self, problem: Problem) -> list[Message]:
        self.options.bonus += 1.0  # the options object is the one every instance shares
        return super().reset(problem)


_SHARED_CALLS: list[int] = []


class SharedList(GoodEnvironment):
    name = "kit_env_shared_list"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.calls = _SHARED_CALLS


_DEEP_CALLS: list[int] = []


class _Game:
    """A helper object per instance, whose list is one module-level list for all."""

    def __init__(self) -> None:
        self.calls = _DEEP_CALLS


class DeepSharedList(GoodEnvironment):
    """Shares a list one attribute deep: ``self.game.calls`` (the shallow check saw only
    ``self.calls``)."""

    name = "kit_env_deep_shared_list"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.game = _Game()

    @tool
    def guess(self, number: int) -> str:
        """Say whether the secret is higher or lower than a number.

        Args:
            number: your guess
        """
        self.game.calls.append(number)
        return super().guess(number)


class _Board:
    """A library's class whose mutable default is a class attribute: every board's moves
    are one list."""

    moves: list[int] = []  # the library bug this fake shows

    def play(self, number: int) -> None:
        self.moves.append(number)


class LibraryClassDefault(GoodEnvironment):
    name = "kit_env_library_class_default"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.board = _Board()

    def answer(self, assistant_text: str) -> Step:
        numbers = re.findall(r"-?\d+", assistant_text)
        self.board.play(int(numbers[-1][:6]) if numbers else 0)
        return super().answer(assistant_text)


class MutatesProblem(GoodEnvironment):
    name = "kit_env_mutates_problem"

    def reset(self, problem: Problem) -> list[Message]:
        problem.metadata["seen"] = problem.metadata.get("seen", 0) + 1  # the group's problem, changed
        return super().reset(problem)


class ReseedsGlobalRandom(GoodEnvironment):
    """Wraps a "library" that reseeds the process-global random on reset and draws from
    it: with trajectories in flight, each one's draws depend on the others."""

    name = "kit_env_reseeds_global_random"

    def reset(self, problem: Problem) -> list[Message]:
        random.seed(problem.id)
        self.hint = random.randint(0, 9)
        return super().reset(problem)


class ReservedComponent(GoodEnvironment):
    name = "kit_env_reserved_component"

    def answer(self, assistant_text: str) -> Step:
        step = super().answer(assistant_text)
        return Step.finish(step.reward, mean=0.75, failed=1.0)


_GAMES = [0]


class GlobalCounter(GoodEnvironment):
    name = "kit_env_global_counter"

    def reset(self, problem: Problem) -> list[Message]:
        _GAMES[0] += 1
        return [*super().reset(problem), {"role": "user", "content": f"This is game {_GAMES[0]}."}]


_CURRENT: dict[str, str] = {}


class CurrentGlobal(GoodEnvironment):
    """Keeps the secret in a module global between reset and close: right when one
    trajectory runs at a time, wrong when a group's trajectories run together."""

    name = "kit_env_current_global"

    def reset(self, problem: Problem) -> list[Message]:
        messages = super().reset(problem)
        _CURRENT["secret"] = self.secret
        return messages

    def answer(self, assistant_text: str) -> Step:
        self.secret = _CURRENT.get("secret", "")
        return super().answer(assistant_text)

    def close(self) -> None:
        _CURRENT.clear()


class CloseBeforeReset(GoodEnvironment):
    name = "kit_env_close_before_reset"

    def __init__(self, options: Any) -> None:
        self.options = options
        self.calls = []

    def close(self) -> None:
        del self.secret  # AttributeError on an instance never reset


class LeaksThread(GoodEnvironment):
    name = "kit_env_leaks_thread"

    def reset(self, problem: Problem) -> list[Message]:
        threading.Thread(target=LEAK_STOP.wait, name="kit-env-leak", daemon=True).start()
        return super().reset(problem)


class LeaksProcess(GoodEnvironment):
    name = "kit_env_leaks_process"

    def reset(self, problem: Problem) -> list[Message]:
        code = "import sys; sys.stdin.read()  # kit-env-child"
        CHILDREN.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE))
        return super().reset(problem)


class Echo(GoodEnvironment):
    name = "kit_env_echo"

    def answer(self, assistant_text: str) -> Step:
        if assistant_text.strip().lstrip("-").isdigit():
            return super().answer(assistant_text)
        return Step.observe({"role": "user", "content": f"You said: {assistant_text}. Answer with a number."})


class StrictParser(GoodEnvironment):
    name = "kit_env_strict_parser"

    def step(self, assistant_text: str) -> Step:
        calls = re.findall(r"<tool_call>(.*?)</tool_call>", assistant_text, re.S)
        if not calls:
            return self.answer(assistant_text)
        out = []
        for body in calls:
            call = json.loads(body)
            out.append({"role": "tool", "content": self.guess(**call["arguments"])})
        return Step(messages=out)


@hookimpl
def forge_environments():
    return [
        GoodEnvironment, OpenOptions, LossyOptions, BadResetRole, StepReturnsDict, UndocumentedTool,
        UntypedTool, ScoresNone, NeverEnds, ClassHistory, MutatesOptions, SharedList, GlobalCounter,
        CurrentGlobal, CloseBeforeReset, LeaksThread, LeaksProcess, Echo, StrictParser, DeepSharedList,
        LibraryClassDefault, MutatesProblem, ReseedsGlobalRandom, ReservedComponent,
        # A record whose factory is a function: the run reads scores and tools from the class.
        EnvironmentBackend("kit_env_function_factory", make_environment, GoodEnvironment.Options),
    ]  # fmt: skip
