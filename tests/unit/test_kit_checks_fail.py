"""Each check of the Reward and Task kits fails on a backend that breaks its rule, with a
message naming what is wrong: a kit that passes everything proves nothing. The broken
backends live in tests/helpers/kit_fakes.py (a plugin loaded by import path); the kit's
test methods are called directly, as pytest would call them on a subclass."""

from __future__ import annotations

import pytest

from forgerl.testing import RewardContract, TaskContract
from forgerl.types import Problem, RewardInput

from ..helpers.timing import scaled

FAKES = ("tests.helpers.kit_fakes",)


def reward_kit(name: str, **attrs):
    return type(f"Kit_{name}", (RewardContract,), {"backend": name, "plugins": FAKES, **attrs})()


def task_kit(name: str, **attrs):
    return type(f"Kit_{name}", (TaskContract,), {"backend": name, "plugins": FAKES, **attrs})()


ALL_REWARD_CHECKS = [n for n in dir(RewardContract) if n.startswith("test_")]
ALL_TASK_CHECKS = [n for n in dir(TaskContract) if n.startswith("test_")]


@pytest.mark.parametrize("check", ALL_REWARD_CHECKS)
def test_a_good_reward_passes_every_check(check):
    getattr(reward_kit("kit_good"), check)()


@pytest.mark.parametrize("check", ALL_TASK_CHECKS)
def test_a_good_task_passes_every_check(check):
    getattr(task_kit("kit_good"), check)()


@pytest.mark.parametrize(
    "backend, check, message",
    [
        ("kit_not_a_reward", "test_builds_a_reward_through_the_registry", "not a forgerl.interfaces.Reward"),
        ("kit_nan_on_empty", "test_every_sample_scores_a_finite_number", r"empty, stop: returned nan"),
        (
            "kit_raises_on_surrogates",
            "test_every_sample_scores_a_finite_number",
            r"lone surrogates, stop: UnicodeEncodeError",
        ),
        ("kit_returns_text", "test_every_sample_scores_a_finite_number", "returned str '1.0', expected a float"),
        ("kit_infinite_component", "test_every_sample_scores_a_finite_number", r"not finite numbers \{'length': inf"),
        ("kit_random", "test_scoring_is_deterministic", "scores the same sample differently"),
        ("kit_async_disagrees", "test_ascore_agrees_with_score", "ascore and score disagree"),
        ("kit_only_in_this_process", "test_scores_the_same_in_a_reward_worker_process", "in a worker .*KeyError"),
    ],
)
def test_each_reward_check_fails_on_a_reward_that_breaks_it(backend, check, message, monkeypatch):
    from tests.helpers.kit_fakes import OnlyInThisProcess

    monkeypatch.setitem(OnlyInThisProcess.here, "value", 1.0)
    kit = reward_kit(backend)
    with pytest.raises(AssertionError, match=message):
        getattr(kit, check)()


def test_known_scores_fail_when_the_reward_scores_otherwise():
    problem = Problem(id="q", prompt="What is 2 + 2?", answer="4")
    kit = reward_kit("kit_good", known_scores=((RewardInput(problem, "it is 5"), 1.0),))
    with pytest.raises(AssertionError, match=r"'it is 5': 0.0, expected 1.0"):
        kit.test_known_scores()


def test_an_unknown_reward_fails_naming_the_fix():
    with pytest.raises(pytest.fail.Exception, match="is the plugin installed"):
        reward_kit("kit_no_such_reward").test_builds_a_reward_through_the_registry()


@pytest.mark.parametrize(
    "backend, check, message",
    [
        ("kit_short_batches", "test_next_problems_returns_n_well_formed_problems", r"next_problems\(200\) returned 100"),
        ("kit_empty_chat_message", "test_next_problems_returns_n_well_formed_problems", "not a {'role': str"),
        ("kit_number_answer", "test_next_problems_returns_n_well_formed_problems", "answer must be a string"),
        ("kit_unpicklable", "test_next_problems_returns_n_well_formed_problems", "cannot be pickled"),
        ("kit_rotating_eval", "test_eval_problems_are_the_same_every_call", "changed after next_problems"),
        ("kit_unseeded", "test_training_stream_is_deterministic_given_the_seed", "yield different problems"),
        ("kit_forgets_position", "test_resumes_exactly_from_its_state", "after 3 problems, a new instance"),
        ("kit_state_not_json", "test_resumes_exactly_from_its_state", "not JSON-serialisable"),
        ("kit_state_dict_draws", "test_resumes_exactly_from_its_state", "changed without drawing"),
        ("kit_answers_out_of_turn", "test_demonstrations_are_rows_a_run_can_train_on",
         r"completion\[0\]: a tool message answers a call"),
        ("kit_never_demonstrates", "test_demonstrations_are_rows_a_run_can_train_on", "returned None for 20 problems"),
    ],
)
def test_each_task_check_fails_on_a_task_that_breaks_it(backend, check, message):
    with pytest.raises(AssertionError, match=message):
        getattr(task_kit(backend), check)()


def test_importing_the_kits_imports_neither_torch_nor_pytest_until_a_kit_is_used():
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import forgerl.testing\n"
        "assert 'pytest' not in sys.modules and 'torch' not in sys.modules, 'import forgerl.testing'\n"
        "from forgerl.testing import EnvironmentContract, GeneratorContract, RewardContract, TaskContract\n"
        "from forgerl.testing import TransportContract\n"
        "assert 'torch' not in sys.modules, 'importing the kits imported torch'\n"
        "assert 'transformers' not in sys.modules, 'importing the kits imported transformers'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=scaled(60))
    assert done.returncode == 0, done.stderr
