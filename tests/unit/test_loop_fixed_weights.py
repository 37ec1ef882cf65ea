"""The loop and a generator that takes no weight updates (``receives_weights = False``, e.g. a
hosted OpenAI-compatible server): it is never sent weights, the run says once that training
is off-policy, and its samples are trained on, not dropped as stale. A generator that does
take weights but lags behind still has its stale samples dropped.

The loop runs for real (rollout thread, batching, checkpoints, metrics) around fakes of the
trainer, generator, task, rewards, sender and tokenizer: no model, no processes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from forgerl.configuration.config import RunConfig
from forgerl.interfaces import Generator, RunContext, Task
from forgerl.registry.plugins import build_registry
from forgerl.runloop.loop import Loop
from forgerl.runloop.spmd import TrainerDriver
from forgerl.types import Completion, Problem, RewardResult

PROMPTS, GROUP = 2, 4


class FakeTrainer:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.batches: list[Any] = []

    def train_step(self, batch: Any) -> dict[str, float]:
        self.calls.append("train_step")
        self.batches.append(batch)
        return {}

    def export_weights(self, version: int) -> Any:
        self.calls.append(f"export_weights {version}")
        return object()

    def save(self, path: Path) -> None:
        (path / "trainer.txt").write_text("state")

    def load(self, path: Path) -> None:
        self.calls.append("load")


class FakeGenerator(Generator):
    """Completions of distinct lengths (rewards differ within a group), labelled with the
    version it serves (``sampled_version``)."""

    def __init__(self) -> None:
        self.updates: list[int] = []
        self._version = 0

    def sampled_version(self) -> int:
        return self._version

    async def generate(self, requests):
        v = self.sampled_version()
        return [
            [Completion([5] * (i + 1), [-0.5] * (i + 1), "stop", v, "x" * (i + 1)) for i in range(r.n)]
            for r in requests
        ]

    def update_weights(self, version: int) -> None:
        self.updates.append(version)
        self._version = version

    @property
    def policy_version(self) -> int:
        return self._version


class FixedWeightsGenerator(FakeGenerator):
    receives_weights = False

    def update_weights(self, version: int) -> None:
        raise AssertionError(f"update_weights({version}) called on a generator that takes no weights")


class LaggingGenerator(FakeGenerator):
    """Takes weight updates, but its engine still samples with version 0 (a broken one)."""

    def sampled_version(self) -> int:
        return 0


class FakeTask(Task):
    def __init__(self) -> None:
        self.served = 0

    def next_problems(self, n: int) -> list[Problem]:
        out = [Problem(id=f"p{self.served + i}", prompt=f"question {self.served + i}", answer="1") for i in range(n)]
        self.served += n
        return out

    def eval_problems(self) -> list[Problem]:
        return [Problem(id="e0", prompt="held out", answer="1")]

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state) -> None:
        self.served = state["served"]


class FakeRewards:
    async def score(self, inputs):
        return [RewardResult(len(i.completion_text) / 10, {"math_answer": len(i.completion_text) / 10}) for i in inputs]


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, weights: Any, timeout: float | None = None) -> None:
        self.sent.append(weights)


class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [2, 3, 4]}


def run_loop(run_dir: Path, generator: FakeGenerator, steps: int, staleness: int = 0, **loop: Any):
    config = RunConfig.model_validate(
        {
            "generator": {"name": "fake"},
            "loop": {
                "steps": steps,
                "prompts_per_step": PROMPTS,
                "group_size": GROUP,
                "max_staleness": staleness,
                "eval_at_start": False,
                "sampling": {"max_tokens": 8},
                **loop,
            },
            "transport": {"timeout": 30},
            "logging": {"tensorboard": False, "progress": False},
        }
    )
    trainer, sender = FakeTrainer(), FakeSender()
    loop = Loop(
        config,
        build_registry(),
        RunContext.for_run(config, run_dir),
        TrainerDriver(trainer, 1),
        generator,
        FakeTask(),
        FakeRewards(),
        sender,
        FakeTokenizer(),
    )
    summary = loop.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, trainer, sender


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_generator_that_takes_no_weights_is_never_sent_any_and_all_its_samples_train(tmp_path, staleness):
    summary, rows, trainer, sender = run_loop(tmp_path, FixedWeightsGenerator(), steps=3, staleness=staleness)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["policy_version"] == 3, "the trainer's version moves on with every step"
    assert not [c for c in trainer.calls if c.startswith("export_weights")], trainer.calls
    assert sender.sent == []
    assert [r["sync/bytes"] for r in rows] == [0, 0, 0]
    assert [r["samples/dropped_stale"] for r in rows] == [0, 0, 0]
    assert [r["samples/trained"] for r in rows] == [PROMPTS * GROUP] * 3
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    # How far off-policy the samples are: batch k was sampled by version 0, trained at k.
    assert [r["staleness/mean"] for r in rows] == [0, 1, 2]


def test_the_run_says_once_that_training_is_off_policy(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="forgerl.runloop.loop"):
        run_loop(tmp_path, FixedWeightsGenerator(), steps=3)
    said = [r.getMessage() for r in caplog.records if "off-policy" in r.getMessage()]
    assert len(said) == 1, said
    assert "'fake' takes no weight updates: every rollout comes from the initial weights" in said[0]


def test_a_generator_that_takes_weights_is_sent_each_version_and_does_not_warn(tmp_path, caplog):
    gen = FakeGenerator()
    with caplog.at_level(logging.WARNING, logger="forgerl.runloop.loop"):
        _, rows, _, sender = run_loop(tmp_path, gen, steps=3)
    assert gen.updates == [1, 2, 3] and len(sender.sent) == 3
    assert [r["samples/dropped_stale"] for r in rows] == [0, 0, 0]
    assert not [r for r in caplog.records if "off-policy" in r.getMessage()]


def test_stale_samples_of_a_generator_that_takes_weights_are_still_dropped(tmp_path):
    gen = LaggingGenerator()
    _, rows, _, _ = run_loop(tmp_path, gen, steps=3)
    assert gen.updates == [1, 2, 3]
    # Its completions report version 0 while the trainer is at 1, 2: dropped from step 2 on.
    assert [r["samples/dropped_stale"] for r in rows] == [0, PROMPTS * GROUP, PROMPTS * GROUP]


def test_a_resumed_run_does_not_send_weights_to_a_generator_that_takes_none(tmp_path):
    run_loop(tmp_path, FixedWeightsGenerator(), steps=2)
    summary, rows, trainer, sender = run_loop(tmp_path, FixedWeightsGenerator(), steps=4)
    assert "load" in trainer.calls, "the second run should have resumed from the checkpoint"
    assert summary["steps"] == 4 and summary["policy_version"] == 4
    assert not [c for c in trainer.calls if c.startswith("export_weights")] and sender.sent == []
    assert [r["samples/dropped_stale"] for r in rows][-2:] == [0, 0]
