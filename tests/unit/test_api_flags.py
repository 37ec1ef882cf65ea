"""The embedding API's ``flags``: a key it does not know is refused on one line that lists
the keys it does know, whatever the value (a misspelt flag is never silently dropped)."""

from __future__ import annotations

import pytest

import forgerl
from forgerl.configuration.kinds import FLAGS
from forgerl.errors import ConfigError

ACCEPTED = "generator, trainer, transport, scheduler, task, rewards, model, steps, output, environment"


@pytest.mark.parametrize("value", [["format"], None, []])
def test_unknown_flag_lists_the_accepted_keys(value):
    with pytest.raises(ConfigError) as caught:
        forgerl.load_config(flags={"model": "tiny", "reward": value})
    message = str(caught.value)
    assert message.startswith(f"unknown flag 'reward': flags accepts {ACCEPTED} "), message
    assert "\n" not in message, message
    assert caught.value.user_fixable


def test_every_accepted_key_is_taken():
    config = forgerl.load_config(
        flags={"model": "tiny", "rewards": ["format"], "steps": 3, "task": "arithmetic", "output": "runs/x"}
    )
    assert (config.model.name, [r.name for r in config.rewards], config.loop.steps) == ("tiny", ["format"], 3)
    assert set(FLAGS) == set(ACCEPTED.split(", "))
