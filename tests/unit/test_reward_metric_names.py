"""A component is logged as ``reward/<name>``, beside the run's own ``reward/mean`` and
``reward/failed``: a component named like those would overwrite the run's figures in
metrics.jsonl (and every tracker) silently. Each place a component name comes from refuses
them: an environment's Step, an agent's returned components, a reward's name (in the
config, one line before launch, and in a RewardSet built by an embedder).

The loop test runs the real loop (rollout thread, environment runner, metrics) around fakes
of the trainer, generator, task and sender, as tests/unit/test_loop_fixed_weights.py does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from forgerl.configuration.config import RunConfig
from forgerl.environment import Environment, Step
from forgerl.errors import ConfigError, RewardError
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Generator, Reward, RunContext
from forgerl.registry.plugins import build_registry
from forgerl.rewards.rewarding import RewardSet
from forgerl.rollouts.agent_runner import check_outcome
from forgerl.rollouts.trajectory import GarbageError, check_step
from forgerl.runloop.loop import Loop
from forgerl.runloop.spmd import TrainerDriver
from forgerl.testing.environment_support import kit_tokenizer
from forgerl.types import Completion, RewardResult
from tests.helpers.timing import scaled
from tests.unit.test_loop_fixed_weights import (
    FakeSender,
    FakeTask,
    FakeTokenizer,
    FakeTrainer,
    FixedWeightsGenerator,
)

PROMPTS, GROUP = 2, 4


class ClaimsRunMetrics(Environment):
    """Every trajectory scores 0.25 and names its components like the run's own metrics."""

    name = "claims_run_metrics"
    scores = True

    def reset(self, problem):
        return [{"role": "user", "content": "Play."}]

    def step(self, assistant_text):
        return Step.finish(0.25, mean=0.75, failed=1.0)


class OwnComponents(ClaimsRunMetrics):
    name = "own_components"

    def step(self, assistant_text):
        return Step.finish(0.25, score=0.75, misses=1.0)


class _Plugin:
    forge_plugin_name = "reward-metric-names-test"

    @hookimpl
    def forge_environments(self):
        return [ClaimsRunMetrics, OwnComponents]


class OneTokenGenerator(Generator):
    receives_weights = False

    @property
    def policy_version(self) -> int:
        return 0

    def update_weights(self, version: int) -> None:
        raise AssertionError("takes no weights")

    async def generate(self, requests):
        return [[Completion([65], [-0.5], "stop", 0, "b")] for _ in requests]


class NoRewards:
    async def score(self, inputs):
        raise AssertionError("a scoring environment's trajectories are not scored by the rewards")


def run_environment(run_dir: Path, environment: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    config = RunConfig.model_validate({
        "generator": {"name": "fake"},
        "environment": {"name": environment, "max_turns": 2},
        "loop": {"steps": 1, "prompts_per_step": PROMPTS, "group_size": GROUP, "eval_at_start": False,
                 "sampling": {"max_tokens": 8}},
        "logging": {"tensorboard": False, "progress": False},
    })  # fmt: skip
    loop = Loop(config, build_registry(plugins=[_Plugin()]), RunContext.for_run(config, run_dir),
                TrainerDriver(FakeTrainer(), 1), OneTokenGenerator(), FakeTask(), NoRewards(), FakeSender(),
                kit_tokenizer())  # fmt: skip
    assert loop.run()["status"] == "completed"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    failures = run_dir / "environment_failures.jsonl"
    lines = failures.read_text().splitlines() if failures.exists() else []
    return [r for r in rows if "reward/mean" in r], [json.loads(line) for line in lines]


def test_components_named_like_the_runs_metrics_never_overwrite_them(tmp_path):
    """Before: reward/mean 0.75 and reward/failed 1.0, though every trajectory scored 0.25
    and none failed. Now each such trajectory fails, with the reason, and the run's own
    figures say so."""
    (row,), failures = run_environment(tmp_path, "claims_run_metrics")
    n = PROMPTS * GROUP
    assert row["reward/mean"] == 0.0 and row["reward/failed"] == n, row  # loop.failed_reward, all counted
    assert row["env/failed_garbage"] == n, row
    trained = [f for f in failures if f["request"].startswith("b0-")]  # the rest: the held-out evaluation
    assert len(trained) == n and all(f["kind"] == "garbage" for f in trained), failures
    assert "step's component 'mean': reward/mean is the run's own metric" in trained[0]["reason"], trained[0]


def test_components_of_other_names_are_logged_beside_the_runs_metrics(tmp_path):
    (row,), failures = run_environment(tmp_path, "own_components")
    assert not failures
    assert row["reward/mean"] == 0.25 and row["reward/failed"] == 0, row
    assert row["reward/score"] == 0.75 and row["reward/misses"] == 1.0, row


@pytest.mark.parametrize("name", ["mean", "failed"])
def test_a_step_or_an_agent_naming_a_component_like_a_run_metric_is_garbage(name):
    with pytest.raises(GarbageError, match=rf"step's component '{name}': reward/{name} is the run's own metric"):
        check_step(Step.finish(1.0, **{name: 1.0}))
    with pytest.raises(GarbageError, match=rf"the agent's component '{name}': reward/{name} is the run's own"):
        check_outcome({"reward": 1.0, "components": {name: 1.0}})
    assert check_step(Step.finish(1.0, **{f"{name}_score": 1.0})).components == {f"{name}_score": 1.0}


def test_a_reward_named_like_a_run_metric_is_refused_by_the_config():
    with pytest.raises(ValidationError, match=r"a reward backend cannot be named 'mean': reward/mean is the run's own"):
        RunConfig.model_validate({"rewards": [{"name": "math_answer"}, {"name": "mean"}]})


def test_forge_refuses_such_a_reward_in_one_line_before_launch(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rewards:\n  - name: failed\n")
    proc = subprocess.run([sys.executable, "-m", "forgerl.cli", "config", "validate", str(cfg)],
                          capture_output=True, text=True, timeout=scaled(60))  # fmt: skip
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rewards.0.name" in lines[0] and "reward/failed is the run's own metric" in lines[0], lines


class _Constant(Reward):
    def score(self, sample):
        return RewardResult(1.0)


def test_a_reward_set_built_by_an_embedder_refuses_such_a_name():
    with pytest.raises(ConfigError, match=r"reward 'failed': reward/failed is the run's own metric"):
        RewardSet([("format", 1.0, _Constant()), ("failed", 1.0, _Constant())])


class ClaimsMean:
    async def score(self, inputs):
        return [RewardResult(0.25, {"mean": 0.75}) for _ in inputs]


def test_the_loop_refuses_a_component_that_would_overwrite_a_run_metric(tmp_path):
    """The last guard: the rewards object an embedder hands to Loop is its own, not checked
    where components are made."""
    config = RunConfig.model_validate({
        "generator": {"name": "fake"},
        "loop": {"steps": 1, "prompts_per_step": PROMPTS, "group_size": GROUP, "eval_at_start": False,
                 "sampling": {"max_tokens": 8}},
        "logging": {"tensorboard": False, "progress": False},
    })  # fmt: skip
    loop = Loop(config, build_registry(), RunContext.for_run(config, tmp_path), TrainerDriver(FakeTrainer(), 1),
                FixedWeightsGenerator(), FakeTask(), ClaimsMean(), FakeSender(), FakeTokenizer())  # fmt: skip
    with pytest.raises(RewardError, match=r"a reward component is named 'mean': reward/mean is the run's own"):
        loop.run()
    rows = (tmp_path / "metrics.jsonl").read_text() if (tmp_path / "metrics.jsonl").exists() else ""
    assert '"reward/mean": 0.75' not in rows, rows
