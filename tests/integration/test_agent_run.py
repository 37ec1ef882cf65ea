"""A black-box agent trains through the run's endpoint: the rank-0 worker of `forge run`
(forgerl.worker.run_worker, what the scheduler starts), in this process, with the tiny
model, the in-process `hf` generator, the fsdp trainer and the `agent` environment running
tests/helpers/openai_agent.py, a program written against the official `openai` client
that knows nothing of forgerl, once per episode.

What is checked: every token the trainer trains on (loss mask 1) is a token the generator
sampled for that episode's calls, at the position it was sampled in, with the sampling
logprob; each row carries the policy version that sampled it (0, then 1 after the first
weight update); the advantages are the group-relative advantages of the rewards the agent
printed; the trainer's logprobs of the sampled tokens equal the generator's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("openai")

from forgerl.configuration.config import validate_config  # noqa: E402
from forgerl.rundirs import runs  # noqa: E402
from tests.helpers.openai_agent import reward_of  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = pytest.mark.integration

AGENT = str(Path(__file__).resolve().parents[1] / "helpers" / "openai_agent.py")


def test_an_openai_client_agent_trains_through_the_endpoint(tmp_path, monkeypatch):
    import forgerl.runloop.loop
    from forgerl.algorithms import group_advantages
    from forgerl.runloop.spmd import TrainerDriver
    from forgerl.worker import run_worker
    from forgerl_plugins.generators.hf.generator import HFGenerator

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    agent_log = tmp_path / "agent.jsonl"
    config = validate_config({
        "model": {"name": "tiny"},
        "generator": {"name": "hf"},
        "trainer": {"name": "fsdp", "options": {"autocast_bf16": False, "lr": 1e-3}},
        "environment": {
            "name": "agent",
            "options": {"command": [sys.executable, AGENT, "chat"], "env": {"AGENT_LOG": str(agent_log)},
                        "timeout": scaled(60.0)},
            "max_turns": 3, "max_total_tokens": 96,
        },
        "loop": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_size": 2, "eval_at_start": False,
                 "sampling": {"max_tokens": 10}},
        "checkpoint": {"every": 0},
        "logging": {"tensorboard": False, "progress": False},
    })
    runs.write_config(run_dir, config)

    sampled: list[tuple[list[int], object]] = []  # (prompt ids, completion) of every call
    batches = []
    generate, train_step = HFGenerator.generate, TrainerDriver.train_step

    async def recording_generate(self, requests):
        results = await generate(self, requests)
        sampled.extend((list(r.prompt_token_ids), c[0]) for r, c in zip(requests, results))
        return results

    def recording_train_step(self, batch):
        batches.append(batch)
        return train_step(self, batch)

    monkeypatch.setattr(HFGenerator, "generate", recording_generate)
    monkeypatch.setattr(TrainerDriver, "train_step", recording_train_step)
    monkeypatch.setattr(forgerl.runloop.loop, "install_stop_handlers", lambda loop: None)  # pytest keeps its own
    assert run_worker(run_dir) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/failed"] == 0 and row["env/turns_mean"] == 2 and row["env/observations_mean"] == 1, row
        assert row["logprob_gap/max"] < 1e-4, f"the trainer and the generator disagree on sampled tokens: {row}"
    assert not (run_dir / "environment_failures.jsonl").exists()
    # 2 steps x 4 episodes + 2 held-out episodes, each one agent process of two calls.
    assert len(agent_log.read_text().splitlines()) == 10 and len(sampled) == 20

    assert len(batches) == 2
    for step, (batch, row) in enumerate(zip(batches, rows)):
        assert batch.policy_versions.tolist() == [step] * batch.size, "on-policy: sampled by the weights of the step"
        rewards, firsts = [], []
        for r in range(batch.size):
            length = int(batch.attention_mask[r].sum())
            tokens = batch.input_ids[r, :length].tolist()
            trained = {t for t in range(length) if batch.loss_mask[r, t]}
            calls = [(p, c) for p, c in sampled
                     if tokens[: len(p)] == p and tokens[len(p): len(p) + len(c.token_ids)] == c.token_ids]
            assert len({len(p) for p, _ in calls}) == 2, f"row {r}: not two calls of one episode"
            covered = {len(p) + i for p, c in calls for i in range(len(c.token_ids))}
            assert trained == covered, f"row {r}: trained positions are not exactly the sampled tokens"
            for p, c in calls:
                assert c.policy_version == step
                got = batch.behaviour_logprobs[r, len(p): len(p) + len(c.token_ids)].tolist()
                assert got == pytest.approx(c.logprobs, abs=1e-6), f"row {r}: behaviour logprobs are not the sampler's"
            last = max(calls, key=lambda pc: len(pc[0]))[1]
            rewards.append(reward_of(last.text))
            firsts.append(tuple(min(calls, key=lambda pc: len(pc[0]))[0]))
        # The reward the agent printed reached the loss: the advantages are its rewards' group-relative ones.
        groups = torch.tensor([sorted(set(firsts)).index(f) for f in firsts])
        expected = group_advantages(torch.tensor(rewards, dtype=torch.float64), groups)
        assert batch.advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-5), (rewards, firsts)
        assert row["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert any(a != 0 for b in batches for a in b.advantages.tolist()), "every reward equal: nothing was learned from"
