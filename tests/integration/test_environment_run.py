"""Environments end to end on the tiny model: `forge run --environment calculator` with the
hf generator and the fsdp trainer, and the exactness of trajectories: the trainer's
logprobs of the sampled tokens equal the generator's (fp32), and environment tokens get
exactly zero gradient."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.environment import Environment, Step  # noqa: E402
from forgerl.rollouts.trajectory import Limits, TrajectoryRunner  # noqa: E402
from forgerl.runloop.batching import collate  # noqa: E402
from forgerl.types import Episode, Problem, SamplingParams  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]


def test_forge_run_with_the_calculator_environment(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [*FORGE, "run", "--model", "tiny", "--generator", "hf", "--environment", "calculator", "--steps", "2",
         "--output", str(out), "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
         "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
         "--set", "environment.max_total_tokens=64", "--set", "trainer.options.autocast_bf16=false"],
        capture_output=True, text=True, env=dict(os.environ), timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("env/turns_mean", "env/failed", "env/sampled_tokens_mean", "reward/correct", "logprob_gap/max"):
        assert key in rows[0], f"{key} missing from {sorted(rows[0])}"
    assert rows[0]["env/failed"] == 0 and rows[0]["logprob_gap/max"] < 1e-4, rows[0]
    assert "eval/accuracy" in rows[-1]
    # The held-out rows carry the environment's components: the tool-call rate among them.
    for key in ("eval/reward/used_tool", "eval/reward/correct", "eval/reward/tagged"):
        assert 0.0 <= rows[-1][key] <= 1.0, f"{key} missing from {sorted(rows[-1])}"
    assert rows[-1]["eval/reward/correct"] == rows[-1]["eval/accuracy"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    # The evaluation before the first step, whole.
    assert summary["eval_start"]["eval/accuracy"] == summary["eval_accuracy_start"]
    assert summary["eval_start"]["eval/samples"] == 4 and "eval/reward/used_tool" in summary["eval_start"]
    config = (out / "config.yaml").read_text()
    assert "name: calculator" in config
    # Its samples hold each trajectory's conversation as messages, and its tokens' text.
    from forgerl.samples import read_samples

    records = read_samples(out)
    train = [r for r in records if r.kind == "train"]
    assert [r.step for r in train] == [1] * 8 + [2] * 8
    for r in records:
        assert r.messages and r.messages[0]["role"] in ("system", "user"), r
        assert r.messages[-1]["role"] == "assistant" and r.messages[-1]["content"] in r.completion, r
        assert r.prompt and r.completion_tokens >= 1 and r.components, r
    assert sorted({r.step for r in records if r.kind == "eval"}) == [0, 2]


# ------------------------------------------------------------------ exactness


class Chatty(Environment):
    """Answers every turn with a user message, three turns: trajectories with environment
    tokens between sampled turns."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, problem):
        return [{"role": "user", "content": str(problem.prompt)}]

    def step(self, text):
        self.turns += 1
        if self.turns == 3:
            return Step.finish(float(len(text) % 2))
        return Step.observe({"role": "user", "content": f"Tool says {self.turns * 17}. Go on."})


@pytest.fixture(scope="module")
def varied_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with rescaled embeddings, so that sampled turns vary (as in
    test_hf_generator.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(0.1 / emb.std())
    out = tmp_path_factory.mktemp("tiny-varied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trajectory_batch(varied_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Four trajectories from the hf generator (fp32, the trainer's temperature), batched as
    the loop batches them."""
    from transformers import AutoTokenizer

    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.hf.generator import HFGenerator
    from forgerl_plugins.transports.shm.transport import ShmTransport

    run_dir = tmp_path_factory.mktemp("env-run")
    transport = ShmTransport(ShmTransport.Options(directory=str(run_dir / "shm")), context=None)
    context = RunContext.for_run(RunConfig(), run_dir, model_path=varied_model)
    generator = HFGenerator(HFGenerator.Options(batch_size=4), context=context, transport=transport)
    tokenizer = AutoTokenizer.from_pretrained(varied_model)
    runner = TrajectoryRunner(
        Chatty, Chatty, tokenizer,
        Limits(max_turns=3, max_total_tokens=120, max_turn_tokens=10, turn_timeout=scaled(10.0), concurrency=4),
        SamplingParams(max_tokens=10, temperature=worker.TEMPERATURE),
    )
    try:
        jobs = [(Problem(f"p{i}", f"What is {i} + {i}?"), f"r{i}", 11 * i) for i in range(4)]
        trajectories, _ = asyncio.run(runner.run_many(generator, jobs))
    finally:
        generator.close()
        transport.close()
    assert all(t.failure is None and t.observations >= 1 for t in trajectories), trajectories
    episodes = [Episode(Problem("p", "q"), 0, t.prompt_ids, t.completion, float(i % 2)) for i, t in enumerate(trajectories)]
    batch = collate(episodes, pad_id=tokenizer.pad_token_id)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch, trajectories


def _env_positions(batch, trajectories):
    """(row, position) of every environment token in the batch."""
    out = []
    for row, t in enumerate(trajectories):
        p = len(t.prompt_ids)
        out += [(row, p + i) for i, m in enumerate(t.completion.mask) if m == 0]
    return out


def test_trainer_logprobs_of_sampled_tokens_equal_the_generators(trajectory_batch, varied_model, tmp_path):
    batch, trajectories = trajectory_batch
    trainer = worker.make_trainer(varied_model, tmp_path, micro_batch_size=2)
    try:
        ours = trainer.logprobs(batch)
        metrics = trainer.train_step(batch)
    finally:
        trainer.close()
    sampled = batch.loss_mask != 0
    gap = (ours - batch.behaviour_logprobs).abs()[sampled].max().item()
    assert gap < 1e-4, f"trainer and generator logprobs of sampled tokens differ by {gap}"
    assert int(sampled.sum()) == sum(sum(t.completion.mask) for t in trajectories)
    # The trainer counts only sampled tokens: an environment token in the loss would add to it.
    assert metrics["train/tokens"] == float(sum(sum(t.completion.mask) for t in trajectories)), metrics
    assert _env_positions(batch, trajectories), "the trajectories have no environment tokens to test"


def test_environment_tokens_get_exactly_zero_gradient(trajectory_batch, varied_model):
    """Backpropagate the GRPO loss of the trajectory batch to the logits: the logits that
    predict an environment token get exactly zero gradient, those of sampled tokens do not."""
    from transformers import AutoModelForCausalLM

    from forgerl.algorithms import AlgorithmConfig, policy_loss

    batch, trajectories = trajectory_batch
    model = AutoModelForCausalLM.from_pretrained(varied_model, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits.retain_grad()
    scaled_logits = logits[:, :-1].float() / worker.TEMPERATURE
    picked = torch.log_softmax(scaled_logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    logprobs = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # position t: token t
    loss, _ = policy_loss(logprobs, None, batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
                          AlgorithmConfig(ratio="behaviour"))
    loss.backward()
    grad = logits.grad
    env = _env_positions(batch, trajectories)
    leaked = [(r, t) for r, t in env if grad[r, t - 1].abs().max().item() != 0.0]
    assert not leaked, f"environment tokens at {leaked[:5]} get a gradient: they leak into the loss"
    sampled = [(r, t) for r in range(batch.size) for t in range(1, batch.input_ids.shape[1]) if batch.loss_mask[r, t]]
    assert all(grad[r, t - 1].abs().max().item() > 0 for r, t in sampled), "a sampled token got no gradient"


def test_a_run_killed_with_pending_trajectories_resumes_exactly(tmp_path):
    """Multi-turn trajectories (the guess game: feedback between turns) one step ahead of
    training (max_staleness 1) are in every checkpoint; a run killed after step 2 resumes
    and ends with the metrics of an uninterrupted run."""
    from tests.helpers.hold_at_step import kill_run_held_at

    common = ["run", "--model", "tiny", "--generator", "hf", "--environment", "guess", "--steps", "3",
              "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2", "--set", "loop.sampling.max_tokens=8",
              "--set", "loop.eval_size=2", "--set", "environment.max_turns=3", "--set", "environment.max_total_tokens=96",
              "--set", "checkpoint.every=1", "--set", "loop.max_staleness=1",
              "--set", "trainer.options.autocast_bf16=false", "--set", "trainer.options.lr=1e-3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    proc = subprocess.run([*FORGE, *common, "--output", str(whole)], capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def pending_trajectories_keep_their_masks() -> None:
        loop_state = json.loads((cut / "checkpoints" / "step-000002" / "loop.json").read_text())
        pending = loop_state["pending_rollouts"]
        assert pending and all("mask" in e["completion"] and "versions" in e["completion"]
                               for b in pending for e in b["episodes"]), "pending trajectories lost their masks"
        assert any(0 in e["completion"]["mask"] for b in pending for e in b["episodes"]), "no environment tokens"

    kill_run_held_at([*FORGE, *common, "--output", str(cut)], cut, 2, before_kill=pending_trajectories_keep_their_masks)
    proc = subprocess.run([*FORGE, "run", "--resume", str(cut)], capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def rows(run: Path) -> list[dict]:
        timing = ("time/", "throughput/", "env/generate_batch_mean")  # batches depend on timing, tokens do not
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(timing)}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    resumed, reference = rows(cut), rows(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert reference[0]["env/observations_mean"] > 0, "the game gave no feedback: nothing multi-turn was tested"
    for a, b in zip(resumed, reference):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7), a["step"]


def test_trajectories_through_vllm_are_token_exact(tmp_path):
    """The vllm generator takes each turn as token ids too: a multi-turn run through vLLM's
    CPU build trains with the trainer's logprobs equal to vLLM's (fp32)."""
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    proc = subprocess.run(
        [*FORGE, "run", "--model", "tiny", "--generator", "vllm", "--environment", "guess", "--steps", "2",
         "--output", str(out), "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2",
         "--set", "loop.sampling.max_tokens=8", "--set", "loop.eval_size=2", "--set", "environment.max_turns=3",
         "--set", "environment.max_total_tokens=96", "--set", "trainer.options.autocast_bf16=false"],
        capture_output=True, text=True, env=dict(os.environ), timeout=scaled(400),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/failed"] == 0 and row["env/observations_mean"] > 0, row
        assert row["logprob_gap/max"] < 1e-4, f"vLLM and the trainer disagree on sampled tokens: {row['logprob_gap/max']}"
