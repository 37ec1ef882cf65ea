"""The plugin's task and environment pass forgerl's conformance kits (forgerl.testing),
run as any third-party plugin runs them: name the backend, and the plugin module when the
distribution is not installed (these tests also run from a checkout, see conftest.py)."""

import json

from forgerl.testing import EnvironmentContract, TaskContract
from forgerl.types import Problem

PLUGIN = ("forgerl_units.plugin",)
MILES = Problem(
    id="q",
    prompt=[{"role": "user", "content": "How many kilometers are in 2 miles?"}],
    answer="3.218688",
    metadata={"value": "2", "from": "mi", "to": "km"},
)


def convert(value, from_unit, to_unit):
    arguments = {"value": value, "from_unit": from_unit, "to_unit": to_unit}
    return f"<tool_call>{json.dumps({'name': 'convert', 'arguments': arguments})}</tool_call>"


class TestUnitsTask(TaskContract):
    backend = "units"
    plugins = PLUGIN
    options = {"eval_size": 8}


class TestUnitsEnvironment(EnvironmentContract):
    backend = "units"
    plugins = PLUGIN
    turns = ("<answer>3.218688</answer>", convert(2, "mi", "km"), "About 3 km.")
    known_rewards = (
        (MILES, [convert(2, "miles", "kilometers"), "<answer>3.219</answer>"], 1.0),  # within 0.1 %
        (MILES, ["<answer>3.2</answer>"], 0.0),  # 0.6 % off
        (MILES, [convert(2, "mi", "kg"), "<answer>2</answer>"], 0.0),
    )

    def problems(self):
        # The environment asks its task's questions: play them.
        from forgerl.testing.registry import backend_under_test

        task = backend_under_test("task", "units", self.plugins).build({}, seed=0)
        return [*task.next_problems(2), MILES]
