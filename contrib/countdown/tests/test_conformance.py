"""The plugin's task and reward pass forgerl's conformance kits (forgerl.testing), run as
any third-party plugin runs them: name the backend, and the plugin module when the
distribution is not installed (these tests also run from a checkout, see conftest.py)."""

from forgerl.testing import RewardContract, TaskContract
from forgerl.types import Problem, RewardInput

PLUGIN = ("forgerl_countdown.plugin",)
GAME = Problem(id="g", prompt="Reach 46 with [3, 7, 25].", answer="46", metadata={"numbers": (3, 7, 25)})


class TestCountdownTask(TaskContract):
    backend = "countdown"
    plugins = PLUGIN
    options = {"numbers": 4, "eval_size": 8}


class TestCountdownReward(RewardContract):
    backend = "countdown"
    plugins = PLUGIN
    completions = ("<answer>1 + 2</answer>", "<answer>(3 - 1) * 2</answer>", "<answer>1/0</answer>")
    known_scores = (
        (RewardInput(GAME, "<answer>25 + 3*7</answer>"), 1.0),
        (RewardInput(GAME, "<answer>25 + 3 + 7</answer>"), 0.1),  # well formed, wrong value
        (RewardInput(GAME, "25 + 3*7"), 0.0),  # no answer tag
    )

    def problems(self):
        # The reward reads the numbers a problem allows from its metadata: score the task's problems.
        from forgerl.testing.registry import backend_under_test

        task = backend_under_test("task", "countdown", self.plugins).build({}, seed=0)
        return task.next_problems(2) + task.eval_problems()[:1]
