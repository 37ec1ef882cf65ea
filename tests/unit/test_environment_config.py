"""The ``environment`` section and ``--environment``: no environment unless named (the
single-turn default), the flag selects one and drops the old one's options, its options are
validated by the environment's own model, and mistakes are one line."""

from __future__ import annotations

import pytest

import forgerl
from forgerl.errors import ConfigError, UnknownBackend


def test_no_environment_by_default():
    config = forgerl.load_config(flags={"model": "tiny"})
    assert config.environment.name is None and config.environment.options == {}


def test_the_flag_selects_one_and_its_options_are_validated_and_filled():
    config = forgerl.load_config(
        flags={"model": "tiny", "environment": "guess"}, sets=["environment.options.high=64", "environment.max_turns=6"]
    )
    assert config.environment.name == "guess" and config.environment.max_turns == 6
    # The resolved config holds the environment's own options model, and writes its values.
    options = config.environment.options
    assert type(options).__qualname__ == "GuessEnvironment.Options" and options.high == 64
    assert config.dump()["environment"]["options"] == {"low": 1, "high": 64, "max_guesses": 5}


def test_a_different_environment_drops_the_old_ones_options(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("environment:\n  name: guess\n  options: {high: 64}\n")
    config = forgerl.load_config(file, flags={"model": "tiny", "environment": "calculator"})
    assert config.environment.name == "calculator"
    assert config.dump()["environment"]["options"] == {"tag": "answer", "tool_bonus": 0.0}


@pytest.mark.parametrize(
    ("sets", "error", "message"),
    [
        (["environment.name=nosuch"], UnknownBackend, "no environment 'nosuch'; installed: agent, calculator, guess"),
        (["environment.name=guess", "environment.options.colour=red"], ConfigError, "environment.options.colour: unknown key"),
        (["environment.name=guess", "environment.options.low=9", "environment.options.high=2"], ConfigError,
         "high (2) must be at least low (9)"),
        (["environment.max_turns=0"], ConfigError, "environment.max_turns"),
        (["environment.turn_timeout=-1"], ConfigError, "environment.turn_timeout"),
        (["environment.concurrency=0"], ConfigError, "environment.concurrency"),
    ],
)
def test_mistakes_are_one_line(sets, error, message):
    with pytest.raises(error) as caught:
        forgerl.load_config(flags={"model": "tiny"}, sets=sets)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    assert caught.value.user_fixable


def test_an_environment_class_is_a_backend_built_once_per_call():
    from forgerl.backends import EnvironmentBackend
    from forgerl.environment import Environment
    from forgerl.errors import PluginError
    from forgerl.registry.backend_classes import record_for_class

    class Minimal(Environment):
        """the smallest environment"""

        name = "minimal"

        def reset(self, problem):
            return [{"role": "user", "content": "hi"}]

    record = record_for_class(EnvironmentBackend, Minimal, "forge_environments")
    assert (record.kind, record.name, record.description) == ("environment", "minimal", "the smallest environment")
    first, second = record.build(None), record.build(None)
    assert isinstance(first, Minimal) and first is not second, "one instance per trajectory"

    class NotOne:
        name = "not_one"

    with pytest.raises(PluginError, match="not an Environment: an environment backend subclasses forgerl.environment.Environment"):
        record_for_class(EnvironmentBackend, NotOne, "forge_environments")


def test_config_show_says_the_rewards_are_unused_when_the_environment_scores():
    """With an environment that scores (``scores = True``), the rewards (the defaults
    math_answer and format included) are never called: `forge config show` says so, as a
    YAML comment, so its output still loads as the same config. An environment that leaves
    scoring to the rewards, and no environment, show them plainly."""
    import subprocess
    import sys

    import yaml

    from tests.helpers.timing import scaled

    def show(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "forgerl.cli", "config", "show", "--model", "tiny", *args],
                              capture_output=True, text=True, timeout=scaled(60))  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    scoring = show("--environment", "guess")
    note = "# rewards: not used in this run: environment 'guess' scores its trajectories itself (scores = True)\n"
    assert note + "rewards:\n- name: math_answer" in scoring, scoring
    assert yaml.safe_load(scoring) == yaml.safe_load(scoring.replace(note, "")), "the note is a comment"
    for args in ((), ("--environment", "agent", "--set", "environment.options.command=['true']")):
        assert "not used in this run" not in show(*args), args
