"""forge eval's driver (core/forgerl/runloop/eval_run.py) around fakes of the generator,
rewards, task and tokenizer: k samples per problem, batched; killed midway it resumes from
its results file without generating or scoring a finished sample again (a line cut off by
the kill is redone); sample 0 of each problem is the request the run's own held-out
evaluation makes, so both give the same row."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from forgerl.configuration.config import build_config
from forgerl.rollouts.rollout import Tokenizing
from forgerl.runloop import eval_run
from forgerl.runloop.evaluation import evaluate_samples, row_of, score_samples
from forgerl.types import Completion, GenerationRequest, Problem, RewardInput, RewardResult

PROBLEMS = [
    Problem(f"p{i}", f"question {i}", str(i), {"source": "odd" if i % 2 else "even"}) for i in range(5)
]


class Generator:
    """Completions that depend on the request's seed only; fails after ``fail_after`` calls."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.requests: list[GenerationRequest] = []
        self.calls = 0
        self.fail_after = fail_after

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("killed")
        self.calls += 1
        self.requests += requests
        return [
            [Completion([1, 2, 3], [0.0] * 3, "stop", 0, text=f"seed {r.sampling.seed % 3}")]
            for r in requests
        ]


class Rewards:
    def __init__(self) -> None:
        self.scored: list[RewardInput] = []

    async def score(self, inputs: list[RewardInput]) -> list[RewardResult]:
        self.scored += inputs
        return [RewardResult(float(s.completion_text == "seed 0"), {"format": float(s.completion_text == "seed 0")})
                for s in inputs]  # fmt: skip


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def setup(tmp_path: Path, k: int, batch: int) -> tuple[Any, Any, Any, Any]:
    config = build_config(sets=["objective=eval", f"eval.k={k}", f"eval.batch_size={batch}", "rewards=[{name: format}]",
                                "loop.eval_temperature=1.0"])  # fmt: skip
    registry = SimpleNamespace(hooks=SimpleNamespace(run_end=lambda **kw: None))
    ctx = SimpleNamespace(run_dir=tmp_path)
    task = SimpleNamespace(eval_problems=lambda: list(PROBLEMS))
    return config, registry, ctx, task


def test_a_killed_evaluation_resumes_without_rescoring_finished_samples(tmp_path: Path) -> None:
    config, registry, ctx, task = setup(tmp_path, k=3, batch=4)
    first, first_rewards = Generator(fail_after=2), Rewards()
    with pytest.raises(RuntimeError, match="killed"):
        eval_run.run_eval(config, registry, ctx, task, first, first_rewards, Tokenizer())
    path = tmp_path / eval_run.SAMPLES_FILE
    written = path.read_text().splitlines()
    assert len(written) == 8, "two batches of four were finished and written"
    # The kill cut the next line off halfway: it is not a finished sample.
    with open(path, "a") as f:
        f.write(written[0][:40].replace('"index": 0', '"index": 9'))

    again, rewards = Generator(), Rewards()
    summary = eval_run.run_eval(config, registry, ctx, task, again, rewards, Tokenizer())
    assert summary["status"] == "completed" and summary["objective"] == "eval"
    done_first = {(json.loads(line)["group"], json.loads(line)["index"]) for line in written}
    redone = {
        (int(r.request_id.split("-")[1]), int(([*r.request_id.split("-"), "0"])[2])) for r in again.requests
    }
    assert len(rewards.scored) == 15 - 8 and not redone & done_first, "a finished sample was generated again"
    records = eval_run.read_records(path)
    assert sorted((r["group"], r["index"]) for r in records) == [(g, j) for g in range(5) for j in range(3)]
    assert [json.dumps(r) for r in records[:8]] == [json.dumps(json.loads(line)) for line in written]
    stats = json.loads((tmp_path / eval_run.SUMMARY_FILE).read_text())
    assert stats["samples"] == 15 and stats["complete"] and set(stats["sources"]) == {"even", "odd"}
    assert stats["pass"]["pass@3"]["mean"] == pytest.approx(
        sum(any(r["correct"] for r in records if r["group"] == g) for g in range(5)) / 5
    )

    # Once more: nothing left to do, nothing generated or scored.
    idle, idle_rewards = Generator(), Rewards()
    eval_run.run_eval(config, registry, ctx, task, idle, idle_rewards, Tokenizer())
    assert idle.requests == [] and idle_rewards.scored == []


def test_the_records_follow_the_shared_per_sample_schema(tmp_path: Path) -> None:
    config, registry, ctx, task = setup(tmp_path, k=2, batch=64)
    eval_run.run_eval(config, registry, ctx, task, Generator(), Rewards(), Tokenizer())
    record = eval_run.read_records(tmp_path / eval_run.SAMPLES_FILE)[3]
    expected = {"kind": "eval", "step": 0, "policy_version": 0, "problem_id": "p1", "group": 1, "index": 1,
                "source": "odd", "prompt": "question 1", "messages": None, "advantage": None, "error": None,
                "finish_reason": "stop", "prompt_tokens": len("question 1"), "completion_tokens": 3}  # fmt: skip
    assert {key: record[key] for key in expected} == expected
    assert isinstance(record["completion"], str) and isinstance(record["reward"], float)
    assert isinstance(record["correct"], bool) and record["components"].keys() == {"format"}


def test_sample_zero_is_the_in_run_evaluation(tmp_path: Path) -> None:
    config, *_ = setup(tmp_path, k=4, batch=64)
    in_run, eval_gen = Generator(), Generator()
    row = evaluate_samples(config, PROBLEMS, in_run, Rewards(), Tokenizing(Tokenizer()))
    pairs = [(g, j) for g in range(len(PROBLEMS)) for j in range(4)]
    samples = score_samples(config, PROBLEMS, pairs, eval_gen, Rewards(), Tokenizing(Tokenizer()))
    assert [r for r in eval_gen.requests if not r.request_id.count("-") - 1] == in_run.requests
    assert row_of([s for s in samples if s.index == 0]) == row
    assert len({r.sampling.seed for r in eval_gen.requests}) == 20, "every sample has its own seed"


def test_a_stop_request_ends_after_the_batch_in_progress(tmp_path: Path) -> None:
    config, registry, ctx, task = setup(tmp_path, k=2, batch=3)
    stop = threading.Event()
    generator = Generator()
    rewards = Rewards()

    class Stopping(Rewards):
        async def score(self, inputs: list[RewardInput]) -> list[RewardResult]:
            stop.set()  # SIGTERM arrived while this batch was scored
            return await rewards.score(inputs)

    summary = eval_run.run_eval(config, registry, ctx, task, generator, Stopping(), Tokenizer(), stop=stop)
    assert (
        summary["status"] == "interrupted"
        and len(eval_run.read_records(tmp_path / eval_run.SAMPLES_FILE)) == 3
    )
    assert json.loads((tmp_path / eval_run.SUMMARY_FILE).read_text())["complete"] is False


class Echo(Generator):
    """A model that repeats what it was shown: the run's key, if it saw it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        return [[Completion([1], [0.0], "stop", 0, text=self.text)] for _ in requests]


def test_the_results_file_holds_no_key_the_model_repeats_and_forge_samples_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from forgerl.cli import cli
    from forgerl.samples.reader import read_samples

    run_key, token = "run-key-0123456789abcdef", "tracker-token-abcdefgh"
    (tmp_path / "transport.secret").write_text(run_key)
    monkeypatch.setenv("WANDB_API_KEY", token)
    config, registry, ctx, task = setup(tmp_path, k=2, batch=4)
    eval_run.run_eval(config, registry, ctx, task, Echo(f"the key is {run_key}, the token {token}"), Rewards(),
                      Tokenizer())  # fmt: skip
    text = (tmp_path / eval_run.SAMPLES_FILE).read_text()
    assert run_key not in text and token not in text and "[redacted]" in text

    records = read_samples(tmp_path)
    assert len(records) == 10 and {r.kind for r in records} == {"eval"} and {r.step for r in records} == {0}
    shown = CliRunner().invoke(cli, ["samples", str(tmp_path), "--grep", "question 3"])
    assert shown.exit_code == 0, shown.output
    assert "question 3" in shown.output and "question 2" not in shown.output and run_key not in shown.output
