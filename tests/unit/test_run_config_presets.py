"""A run config takes every preset value from the preset table; a value the user wrote
wins; knobs measured in tokens are derived from max_tokens only when neither sets them."""

from __future__ import annotations

import pytest

from forgerl.algorithms import PRESETS
from forgerl.configuration.config import build_config
from forgerl.errors import ConfigError


def algorithm(*sets: str):
    return build_config(sets=sets).algorithm


def test_a_dapo_run_keeps_the_presets_overlong_buffer():
    algo = algorithm("algorithm.preset=dapo", "loop.sampling.max_tokens=8192")
    assert algo.overlong == "soft_penalty"
    assert algo.overlong_buffer == PRESETS["dapo"]["overlong_buffer"] == 4096


def test_the_users_overlong_buffer_wins_over_the_preset():
    algo = algorithm(
        "algorithm.preset=dapo", "loop.sampling.max_tokens=8192", "algorithm.overlong_buffer=512"
    )
    assert algo.overlong_buffer == 512
    # An explicit 0 (a cliff at max_tokens, no ramp) is the user's choice too.
    assert algorithm("algorithm.preset=dapo", "algorithm.overlong_buffer=0").overlong_buffer == 0


def test_the_derived_buffer_applies_only_when_nothing_sets_one():
    # grpo has no ramp of its own: switching soft_penalty on derives a quarter of max_tokens.
    algo = algorithm("algorithm.overlong=soft_penalty", "loop.sampling.max_tokens=200")
    assert (algo.preset, algo.overlong_buffer) == ("grpo", 50)
    algo = algorithm(
        "algorithm.preset=gspo", "algorithm.overlong=soft_penalty", "algorithm.overlong_buffer=7"
    )
    assert algo.overlong_buffer == 7
    # Without soft_penalty nothing is derived: the preset's value stands.
    assert algorithm("loop.sampling.max_tokens=200").overlong_buffer == PRESETS["grpo"]["overlong_buffer"]
    assert algorithm("algorithm.preset=dapo", "algorithm.overlong=mask").overlong_buffer == 4096


def test_a_preset_buffer_that_does_not_fit_says_where_it_came_from_and_how_to_fix_it():
    with pytest.raises(ConfigError) as err:
        algorithm("algorithm.preset=dapo", "loop.sampling.max_tokens=64")
    message = str(err.value)
    assert "overlong_buffer (4096, the dapo preset's) must be below loop.sampling.max_tokens (64)" in message
    assert "set algorithm.overlong_buffer (e.g. 16" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"overlong_buffer \(100\) must be below"):
        algorithm("algorithm.preset=dapo", "algorithm.overlong_buffer=100")


def test_the_constant_normaliser_follows_the_table_and_the_user():
    # dr_grpo's loss_agg comes from the table, so its constant is derived from max_tokens.
    assert algorithm("algorithm.preset=dr_grpo", "loop.sampling.max_tokens=300").loss_norm_constant == 300
    # Any preset switched to constant_norm gets it too; the user's constant wins.
    assert algorithm("algorithm.loss_agg=constant_norm").loss_norm_constant == 64
    assert algorithm("algorithm.preset=dr_grpo", "algorithm.loss_norm_constant=10").loss_norm_constant == 10
    # A preset that does not normalise by a constant gets none.
    assert algorithm("algorithm.preset=dapo", "algorithm.overlong_buffer=8").loss_norm_constant is None
