"""The reasoning_gym task and reward: the conformance kits, scores from the datasets' own
scorers, exact resume, and one-line errors for a bad dataset name or config."""

from __future__ import annotations

import json

import pytest

from forgerl.errors import ConfigError
from forgerl.testing import RewardContract, TaskContract
from forgerl.types import RewardInput
from forgerl_reasoning_gym.gym import ReasoningGymReward, ReasoningGymTask

PLUGIN = ("forgerl_reasoning_gym.plugin",)
OPTIONS = {
    "datasets": [
        {"name": "basic_arithmetic", "weight": 2},
        {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 3}},
    ],
    "size": 50,
    "eval_size": 4,
}


def task(seed=0, **options):
    return ReasoningGymTask(ReasoningGymTask.Options.model_validate({**OPTIONS, **options}), seed=seed)


class TestReasoningGymTask(TaskContract):
    backend = "reasoning_gym"
    plugins = PLUGIN
    options = OPTIONS


class TestReasoningGymReward(RewardContract):
    backend = "reasoning_gym"
    plugins = PLUGIN
    completions = ("<answer>3</answer>", "no tag at all", "<answer></answer>")

    def problems(self):
        return task().next_problems(3)


def test_the_datasets_own_scorer_scores_the_tagged_answer():
    reward = ReasoningGymReward()
    for problem in task().next_problems(6):
        right = reward.score(RewardInput(problem, f"Thinking... <answer>{problem.answer}</answer>"))
        assert right.value == 1.0 and right.components == {"answered": 1.0}, problem
        wrong = reward.score(RewardInput(problem, "<answer>not a number</answer>"))
        assert wrong.value < 1.0
        assert reward.score(RewardInput(problem, problem.answer)).components == {"answered": 0.0}


def test_weights_system_prompt_and_held_out_items():
    problems = task().next_problems(30)
    names = [p.metadata["reasoning_gym"]["dataset"] for p in problems]
    assert names.count("basic_arithmetic") == 20 and names.count("chain_sum") == 10
    assert problems[0].prompt[0]["role"] == "system" and "<answer>" in problems[0].prompt[0]["content"]
    held = task().eval_problems()
    assert len(held) == 8 and not {p.id for p in held} & {p.id for p in problems}
    assert json.loads(json.dumps(problems[0].metadata)) == problems[0].metadata, "metadata is plain JSON"
    assert task(system_prompt=None).next_problems(1)[0].prompt[0]["role"] == "user"


def test_resume_draws_what_an_unbroken_run_would():
    straight = [p.id for p in task(seed=3).next_problems(40)]
    first = task(seed=3)
    head = [p.id for p in first.next_problems(13)]
    resumed = task(seed=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [p.id for p in resumed.next_problems(27)] == straight


def test_bad_names_and_configs_are_one_line():
    with pytest.raises(
        ConfigError, match="reasoning_gym dataset 'no_such_gym': .*datasets: .*basic_arithmetic"
    ):
        task(datasets=[{"name": "no_such_gym"}])
    with pytest.raises(ConfigError, match="reasoning_gym dataset 'chain_sum': .*bogus"):
        task(datasets=[{"name": "chain_sum", "config": {"bogus": 1}}])
