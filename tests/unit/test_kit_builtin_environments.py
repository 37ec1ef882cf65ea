"""forgerl's own environments pass the Environment kit of forgerl.testing, run the way a
third-party plugin runs it: by naming the backend and the turns it is meant to receive."""

from __future__ import annotations

import json

from forgerl.testing import EnvironmentContract
from forgerl.types import Problem

QUESTION = Problem(id="q", prompt="What is 17 * 23?", answer="391", metadata={"a": 17, "op": "*", "b": 23})


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class TestCalculatorEnvironment(EnvironmentContract):
    backend = "calculator"
    turns = (call("calculate", expression="17 + 25"), "<answer>42</answer>", "It is 4.")
    known_rewards = (
        (QUESTION, [call("calculate", expression="17 * 23"), "<answer>391</answer>"], 1.0),
        (QUESTION, ["<answer>390</answer>"], 0.0),
    )


class TestGuessEnvironment(EnvironmentContract):
    backend = "guess"
    options = {"low": 1, "high": 8, "max_guesses": 3}
    turns = ("4", "I guess 6.", "no idea")


class TestPythonEnvironment(EnvironmentContract):
    """Every tool call of the kit's batteries runs a real program in the sandbox."""

    backend = "python"
    options = {"timeout": 2.0, "turn_seconds": 6.0}
    shared = ("sandbox",)  # one per process and options, by design: its slots bound the programs at once
    # The answer first: the hostile check follows every hostile turn with it, and a program
    # there would run twice per hostile text.
    turns = ("<answer>42</answer>", call("run_python", code="print(17 + 25)"))
    known_rewards = (
        (QUESTION, [call("run_python", code="print(17 * 23)"), "<answer>391</answer>"], 1.0),
        (QUESTION, [call("run_python", code="while True: pass"), "<answer>7</answer>"], 0.0),
    )


def test_python_environment_instances_built_at_once_share_one_sandbox():
    """The run builds its first ``environment.concurrency`` instances on as many threads at
    once; each used to miss the cache and probe and build a sandbox of its own (found by the
    kit's state check, which now plays every trajectory at once)."""
    import threading

    from forgerl.registry.plugins import build_registry

    record = build_registry().require("environment", "python")
    options = record.validate_options({"timeout": 2.75})  # options no other test builds a sandbox for
    start, built = threading.Barrier(6), []

    def build():
        start.wait(timeout=60)
        built.append(record.build(options))

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(built) == 6 and len({id(env.sandbox) for env in built}) == 1, [env.sandbox for env in built]
