"""With ``loop.max_staleness: 0`` the per-token version path trains bit for bit like the
synchronous loop it replaces.

Three short runs of the real loop, in this process: the ``hf`` generator and the ``fsdp``
trainer (one rank) on the tiny model, weights moving through the ``shm`` transport, the
same seed. The *synchronous* run is the loop as it was before per-token versions: its
completions carry one version each, stale samples are dropped, and the trainer is handed
batches without token versions (so no per-age code runs there). The *per-token* run labels
every token with its version (as a completion that ran across an update under ``keep`` is
labelled), masks stale tokens (``loop.stale_samples: mask``) and gives the trainer the
token ages. Their final weights must be equal bit for bit. The *perturbed* run is the
per-token one with a single token per step relabelled one version older: it must train
differently, which shows that the comparison sees what the labels do.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from forgerl.configuration.config import RunConfig
from forgerl.interfaces import Generator, RunContext, Task
from forgerl.registry.plugins import build_registry
from forgerl.runloop.loop import Loop
from forgerl.runloop.spmd import TrainerDriver
from forgerl.types import Problem, RewardResult

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Two cores shared with other test runs: intra-op threads on 64-wide matrices only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its embeddings rescaled to std 0.1 (as in test_hf_generator): at
    the builder's scale every completion copies its prompt, rewards never vary, and no run
    would learn anything to compare."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(0.1 / emb.std())
    out = tmp_path_factory.mktemp("tiny-varied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


class Labelled(Generator):
    """The hf generator, its completions labelled with per-token ``versions`` as the vllm
    generator labels a completion that ran across an update; ``older_first`` relabels the
    first token of each batch's first completion one version older (from version 1 on)."""

    def __init__(self, inner: Any, older_first: bool) -> None:
        self.inner = inner
        self.older_first = older_first

    @property
    def policy_version(self) -> int:
        return int(self.inner.policy_version)

    def update_weights(self, version: int) -> None:
        self.inner.update_weights(version)

    async def generate(self, requests):
        results = await self.inner.generate(requests)
        for comps in results:
            for c in comps:
                c.versions = [c.policy_version] * len(c.token_ids)
        # The first completion with a token left to train on once its first one is masked.
        first = next(c for comps in results for c in comps if len(c.token_ids) > 1)
        if self.older_first and first.policy_version > 0:
            assert first.versions is not None
            first.versions[0] = first.policy_version - 1
            first.policy_version -= 1  # the oldest token's, as labelled completions carry
        return results


class WithoutTokenVersions:
    """The trainer as the synchronous loop drove it: batches without per-token versions."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def train_step(self, batch):
        return self.trainer.train_step(dataclasses.replace(batch, token_versions=None, trainer_version=None))


class Arithmetic(Task):
    def __init__(self) -> None:
        self.served = 0

    def next_problems(self, n: int) -> list[Problem]:
        out = [Problem(id=f"p{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i))
               for i in range(self.served, self.served + n)]
        self.served += n
        return out

    def eval_problems(self) -> list[Problem]:
        return [Problem(id="e0", prompt="What is 1 + 1?", answer="2")]

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state) -> None:
        self.served = state["served"]


class TextReward:
    """A deterministic score of the text that varies between completions (so groups have
    reward variance and every step learns)."""

    async def score(self, inputs):
        return [RewardResult((sum(map(ord, i.completion_text)) % 7) / 6, {}) for i in inputs]


def train(model_dir: Path, run_dir: Path, path: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """STEPS steps of the loop along ``path`` (synchronous, per_token, perturbed); the
    trainer's final weights and the metrics rows."""
    config = RunConfig.model_validate({
        "generator": {"name": "hf", "options": {"batch_size": 8}},
        "trainer": {"name": "fsdp", "options": {"lr": 1e-3, "autocast_bf16": False, "micro_batch_size": 4}},
        "transport": {"name": "shm", "timeout": 120, "options": {"directory": str(run_dir / "shm")}},
        "loop": {
            "steps": STEPS, "prompts_per_step": 2, "group_size": 4, "max_staleness": 0,
            "stale_samples": "drop" if path == "synchronous" else "mask",
            "eval_at_start": False, "eval_size": 1, "sampling": {"max_tokens": 8}, "seed": 3,
        },
        "logging": {"tensorboard": False, "progress": False},
    })
    registry = build_registry()
    ctx = RunContext.for_run(config, run_dir, model_path=model_dir)
    from transformers import AutoTokenizer

    trainer = registry.require("trainer", "fsdp").build(config.trainer.options, context=ctx)
    transport = registry.require("transport", "shm").build(config.transport.options, context=ctx)
    sender = transport.sender()
    generator = registry.require("generator", "hf").build(config.generator.options, context=ctx, transport=transport)
    try:
        if path == "synchronous":
            served, driven = generator, WithoutTokenVersions(trainer)
        else:
            served, driven = Labelled(generator, older_first=path == "perturbed"), trainer
        loop = Loop(config, registry, ctx, TrainerDriver(driven, 1), served, Arithmetic(), TextReward(), sender,
                    AutoTokenizer.from_pretrained(model_dir))
        assert loop.run()["status"] == "completed"
        exported = trainer.export_weights(STEPS + 1)
        assert exported is not None
        weights = {k: v.clone() for k, v in exported.tensors.items()}
    finally:
        for part in (generator, sender, transport, trainer):
            part.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return weights, rows


def test_staleness_0_trains_bit_for_bit_like_the_synchronous_loop(model_dir: Path, tmp_path: Path):
    sync_w, sync_rows = train(model_dir, tmp_path / "synchronous", "synchronous")
    token_w, token_rows = train(model_dir, tmp_path / "per_token", "per_token")
    bumped_w, bumped_rows = train(model_dir, tmp_path / "perturbed", "perturbed")

    assert all(r["grad_norm"] > 0 for r in sync_rows), "a step learned nothing: the comparison would prove nothing"
    assert sync_w.keys() == token_w.keys()
    differ = [k for k in sync_w if not torch.equal(sync_w[k], token_w[k])]
    assert not differ, f"per-token versions changed the update at staleness 0: {differ}"
    for a, b in zip(sync_rows, token_rows):
        for key in ("loss", "grad_norm", "logprob_gap/mean", "samples/trained", "reward/mean"):
            assert a[key] == b[key], (a["step"], key)

    # The per-token path's own metrics: every trained token is of the trainer's version.
    for r in token_rows:
        assert r["staleness/tokens_masked"] == 0 and r["samples/dropped_stale"] == 0
        assert r["staleness/tokens_age_0"] == r["train/tokens"]
        assert r["logprob_gap/age_0"] == pytest.approx(r["logprob_gap/mean"], rel=1e-6)
    assert "logprob_gap/age_0" not in sync_rows[0], "the synchronous path must not have taken the per-age code"

    # One token per step relabelled a version older: masked from step 2 on, and it shows.
    assert [r["staleness/tokens_masked"] for r in bumped_rows] == [0, 1, 1]
    assert any(not torch.equal(sync_w[k], bumped_w[k]) for k in sync_w), (
        "relabelling a token did not change the weights: the bit-for-bit check cannot see the labels"
    )
