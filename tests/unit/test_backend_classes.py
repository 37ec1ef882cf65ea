"""One backend, one class: a plugin registers a class that holds its name, options and
implementation (discovered through a real entry point of a fake distribution)."""

from __future__ import annotations

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput

from .fakedist import make_dist

SHORT_REWARD = """
from pydantic import Field
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward
from forgerl.options import OptionsModel

class ShortReward(Reward):
    '''Shorter completions score higher.'''

    name = "short"
    requires = ("json",)

    class Options(OptionsModel):
        limit: int = Field(10, ge=1)

    def __init__(self, options: Options):
        self.limit = options.limit

    def score(self, sample):
        return float(len(sample.completion_text) <= self.limit)

    @staticmethod
    def preflight(options):
        if options.limit == 7:
            raise ValueError("seven is unlucky")

@hookimpl
def forge_rewards():
    return [ShortReward]
"""


def test_a_backend_class_is_its_record_name_options_and_implementation(site):
    make_dist(site, "fake-short", "1.0", {"short": SHORT_REWARD})
    record = build_registry().require("reward", "short")
    assert record.description == "Shorter completions score higher"  # from the docstring
    assert record.requires == ("json",) and "fake-short 1.0" in record.provider
    reward = record.build({"limit": 3})
    assert reward.score(RewardInput(Problem(id="p", prompt=""), "abc")) == 1.0
    assert reward.score(RewardInput(Problem(id="p", prompt=""), "abcd")) == 0.0
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        record.validate_options({"limit": 0})
    with pytest.raises(ValueError, match="unlucky"):
        record.check_before_run({"limit": 7})


def test_a_class_registered_by_import_path_is_loaded_when_the_registry_is_built(site):
    source = SHORT_REWARD.replace("return [ShortReward]", 'return ["fake_short_short:ShortReward"]')
    make_dist(site, "fake-short", "1.0", {"short": source})
    assert build_registry().require("reward", "short").build({}).limit == 10


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('    name = "short"\n', ""), "has no `name` of its own: give it a class attribute `name"),
        (("return [ShortReward]", "return [object]"), "which is not a Reward"),
        (("return [ShortReward]", 'return ["fake_short_nowhere:ShortReward"]'), "which cannot be imported"),
    ],
    ids=["no-name", "not-a-reward", "not-importable"],
)
def test_a_wrong_class_skips_its_plugin_with_one_line_saying_what_to_fix(site, capsys, change, message):
    make_dist(site, "fake-short", "1.0", {"short": SHORT_REWARD.replace(*change)})
    registry = build_registry()
    err = capsys.readouterr().err
    assert "plugin 'short' (fake-short 1.0) registers something wrong" in err and message in err, err
    assert "short" not in registry.backends("reward")
