"""Each check of the Environment kit fails on an environment that breaks its rule, with the
message docs/plugins-environment.md says it gives: a kit that passes everything proves
nothing. The broken environments live in tests/helpers/kit_fake_environments.py (a plugin
loaded by import path); the kit's test methods are called directly, as pytest would call
them on a subclass."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from forgerl.testing import EnvironmentContract
from forgerl.testing.environment_support import KIT_CHAT_TEMPLATE, kit_tokenizer
from forgerl.types import Problem

FAKES = ("tests.helpers.kit_fake_environments",)

ALL_CHECKS = [n for n in dir(EnvironmentContract) if n.startswith("test_")]


def kit(name: str, **attrs):
    attrs = {"backend": name, "plugins": FAKES, "cleanup_wait_s": 1.0, **attrs}
    return type(f"Kit_{name}", (EnvironmentContract,), attrs)()


@pytest.mark.parametrize("check", ALL_CHECKS)
def test_a_good_environment_passes_every_check(check):
    getattr(kit("kit_env_good"), check)()


@pytest.mark.parametrize(
    "backend, check, message",
    [
        ("kit_env_function_factory", "test_builds_an_environment_through_the_registry",
         r"factory <function make_environment.*not an Environment subclass"),
        ("kit_env_open_options", "test_options_refuse_unknown_keys", r"accepted the unknown key 'kit_unknown_option'"),
        ("kit_env_lossy_options", "test_options_refuse_unknown_keys", r"do not survive the run's round trip"),
        ("kit_env_bad_reset_role", "test_reset_returns_valid_messages",
         r"problem 'kit/arithmetic', reset: reset: message 0 needs a role in .* \(env/failed_garbage\)"),
        ("kit_env_step_returns_dict", "test_step_returns_a_step", r"step returned dict, not a Step \(env/failed_garbage\)"),
        ("kit_env_reserved_component", "test_step_returns_a_step",
         r"step's component 'mean': reward/mean is the run's own metric .*\(env/failed_garbage\)"),
        ("kit_env_undocumented_tool", "test_tools_have_schemas_a_model_can_read", r"tool 'hint' has no description"),
        ("kit_env_untyped_tool", "test_tools_have_schemas_a_model_can_read",
         r"cannot be derived: tool hint: parameter 'digits' has no type annotation"),
        ("kit_env_scores_none", "test_scoring_environment_ends_with_a_finite_reward",
         r"scores = True but ended these trajectories with reward None"),
        ("kit_env_never_ends", "test_scoring_environment_ends_with_a_finite_reward", r"no trajectory ended within 4 turns"),
        ("kit_env_class_history", "test_no_state_leaks_between_instances",
         r"changed class attributes of ClassHistory or of the objects its instances hold: ClassHistory.history"),
        ("kit_env_library_class_default", "test_no_state_leaks_between_instances",
         r"changed class attributes of LibraryClassDefault .*: _Board.moves \(type\(self.board\).moves\)"),
        ("kit_env_mutates_problem", "test_no_state_leaks_between_instances",
         r"changed the problems given to reset: \['kit/arithmetic', 'kit/plain'\]"),
        ("kit_env_mutates_options", "test_no_state_leaks_between_instances",
         r"changed the options every instance shares: \{\"bonus\": 0.0\} became"),
        ("kit_env_shared_list", "test_no_state_leaks_between_instances",
         r"share mutable objects: .*\n\s+self.calls of instance 1 is self.calls of instance 2"),
        ("kit_env_deep_shared_list", "test_no_state_leaks_between_instances",
         r"share mutable objects: .*\n\s+self.game.calls of instance 1 is self.game.calls of instance 2"),
        ("kit_env_reseeds_global_random", "test_leaves_the_global_random_state_alone",
         r"changed the state of the process-global random generator \(random\).*own random.Random\(seed\)"),
        ("kit_env_global_counter", "test_no_state_leaks_between_instances",
         r"played differently on a fresh instance after other trajectories"),
        ("kit_env_current_global", "test_no_state_leaks_between_instances",
         r"\d+ trajectories played at the same time \(as a run plays them.*\) differ from each played alone:\n\s+"
         r"problem 'kit/arithmetic', "),
        ("kit_env_close_before_reset", "test_close_releases_what_the_instance_holds",
         r"an instance never reset: close raised AttributeError"),
        ("kit_env_leaks_thread", "test_close_releases_what_the_instance_holds",
         r"threads the environment started still run after close\(\):\s+kit-env-leak"),
        ("kit_env_leaks_process", "test_close_releases_what_the_instance_holds",
         r"processes the environment started still run after close\(\): \d+: .*kit-env-child"),
        ("kit_env_echo", "test_hostile_model_text_is_answered",
         r"problem 'kit/arithmetic', huge, then .*: step: message 0 has \d+ characters \(at most 100000\)"),
        ("kit_env_strict_parser", "test_hostile_model_text_is_answered",
         r"tool call that is not JSON, then .*: step 1 raised JSONDecodeError: .* at .*kit_fake_environments.py:\d+ "
         r"\(env/failed_error\)"),
    ],
)  # fmt: skip
def test_each_environment_check_fails_on_an_environment_that_breaks_it(backend, check, message):
    from tests.helpers.kit_fake_environments import CHILDREN, LEAK_STOP

    LEAK_STOP.clear()
    try:
        with pytest.raises(AssertionError, match=message):
            getattr(kit(backend), check)()
    finally:
        LEAK_STOP.set()
        for child in CHILDREN:
            child.kill()
            child.wait()
        CHILDREN.clear()


def test_known_rewards_fail_when_the_environment_scores_otherwise():
    problem = Problem(id="q", prompt="Guess.", answer="7")
    bad = kit("kit_env_good", known_rewards=((problem, ["6"], 1.0), (problem, ['<tool_call>{"name": "guess", '
              '"arguments": {"number": 3}}</tool_call>'], 0.0)))  # fmt: skip
    with pytest.raises(AssertionError, match=r"problem 'q', .*ended with reward 0.0, expected 1.0\n.*did not end"):
        bad.test_known_rewards()


def test_the_runner_check_fails_when_the_models_template_cannot_render_the_observations(tmp_path: Path):
    """With ``tokenizer`` naming a model folder, its chat template renders the trajectories:
    a template without a ``tool`` role (Llama 2's raise on anything but user/assistant)
    cannot take the tool answers of the default step."""
    tok = copy.deepcopy(kit_tokenizer())
    loop = "{% for message in messages %}"
    tok.chat_template = KIT_CHAT_TEMPLATE.replace(
        loop, loop + "{% if message['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    )
    tok.save_pretrained(tmp_path)
    with pytest.raises(AssertionError, match=r"a plain call of tool 'guess': .*no tool role \(env/failed_error\)"):
        kit("kit_env_good", tokenizer=str(tmp_path)).test_trajectories_run_in_the_runs_trajectory_runner()


def test_an_unknown_environment_fails_naming_the_fix():
    with pytest.raises(pytest.fail.Exception, match="is the plugin installed"):
        kit("kit_env_no_such_environment").test_builds_an_environment_through_the_registry()
