"""Samples whose tokens come from several policy versions (update policy ``keep``, multi-turn
trajectories): per-token versions travel from the Completion into the TrainBatch, the loss
weighs every token by its own sampling logprob, staleness counts from the oldest token, and
``loop.stale_samples`` drops or masks what is too old.

Every expected number below is worked out by hand from the batch written next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from forgerl.algorithms import AlgorithmConfig, gap_age_key, policy_loss
from forgerl.rollouts.staleness import age_counts, filter_stale, oldest_version
from forgerl.runloop.batching import collate, prepare_batch, tokens_by_age
from forgerl.types import Completion, Episode, Problem

from .test_loop_fixed_weights import GROUP, PROMPTS, FakeGenerator, run_loop

PROMPT = [7, 8, 9]
# One completion that ran across the update from version 3 to 4: tokens 0-1 sampled by
# version 3, tokens 2-3 by version 4, each with the logprob its own sampler gave it.
TOKENS = [11, 12, 13, 14]
VERSIONS = [3, 3, 4, 4]
SAMPLED_LP = [-1.1, -0.9, -0.5, -0.8]
# The trainer's logprobs of the same tokens (version 4's weights: the batch trains at 4).
TRAINER_LP = [-1.0, -0.6, -0.5, -0.7]
TRAINER_VERSION = 4
# The batch holds sampling logprobs in float32: the hand computations start from those.
SAMPLED_LP32 = [float(torch.tensor(x, dtype=torch.float32)) for x in SAMPLED_LP]


def _episode(completion: Completion, group: int = 0, reward: float = 1.0) -> Episode:
    return Episode(Problem(id="p", prompt="q"), group, list(PROMPT), completion, reward)


def _crossing() -> Completion:
    return Completion(list(TOKENS), list(SAMPLED_LP), "stop", policy_version=3, versions=list(VERSIONS))


def _loss(cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """policy_loss on the collated crossing sample with advantage +1; returns the loss, its
    metrics and d loss / d logprob at the completion's four positions."""
    batch = collate([_episode(_crossing())], pad_id=0)
    batch.trainer_version = TRAINER_VERSION
    p = len(PROMPT)
    lp = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    lp[0, p:] = torch.tensor(TRAINER_LP, dtype=torch.float64)
    lp.requires_grad_(True)
    ages = batch.token_ages()
    assert ages is not None
    loss, metrics = policy_loss(
        lp,
        lp.detach() if cfg.ratio == "old" else None,
        batch.behaviour_logprobs.double(),
        torch.ones(1, dtype=torch.float64),
        batch.loss_mask,
        cfg,
        token_ages=ages,
    )
    loss.backward()
    assert lp.grad is not None
    return loss, metrics, lp.grad[0, p:]


def test_versions_and_sampling_logprobs_travel_into_the_batch_token_by_token():
    plain = Completion([21, 22], [-0.3, -0.4], "stop", policy_version=4)
    batch = collate([_episode(_crossing()), _episode(plain)], pad_id=0)
    p = len(PROMPT)
    assert batch.token_versions is not None
    assert batch.token_versions[0, p:].tolist() == VERSIONS
    assert batch.token_versions[1, p : p + 2].tolist() == [4, 4], "one version for every token of a plain completion"
    assert batch.behaviour_logprobs[0, p:].tolist() == pytest.approx(SAMPLED_LP)
    assert batch.policy_versions.tolist() == [3, 4], "a row's version is its oldest token's"
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_the_behaviour_ratio_uses_each_tokens_own_sampling_logprob():
    loss, metrics, grad = _loss(AlgorithmConfig(ratio="behaviour", clip_low=0.2, clip_high=0.2, loss_agg="token_mean"))
    # r_t = exp(trainer - own sampler) = e^0.1, e^0.3, e^0, e^0.1; A = +1, so token 1
    # (r = 1.35 > 1.2) is clipped: objective 1.2, no gradient. Token mean over 4 tokens.
    r = [math.exp(a - b) for a, b in zip(TRAINER_LP, SAMPLED_LP32)]
    assert r[1] > 1.2 and all(x < 1.2 for x in (r[0], r[2], r[3]))
    assert loss.item() == pytest.approx(-(r[0] + 1.2 + r[2] + r[3]) / 4, abs=1e-12)
    assert grad.tolist() == pytest.approx([-r[0] / 4, 0.0, -r[2] / 4, -r[3] / 4], abs=1e-12)
    assert metrics["clip/high_frac"] == pytest.approx(0.25)
    assert metrics["ratio/max"] == pytest.approx(r[1])


def test_truncated_importance_sampling_weighs_each_token_by_its_own_sampler():
    _, _, grad = _loss(AlgorithmConfig(ratio="old", tis_cap=1.2, clip_low=0.2, clip_high=0.2, loss_agg="token_mean"))
    # ratio 'old' is 1 at every token, so d loss / d lp_t = -A w_t / 4 with
    # w_t = min(exp(old_t - behaviour_t), 1.2): token 1's e^0.3 is cut to the cap.
    w = [min(math.exp(a - b), 1.2) for a, b in zip(TRAINER_LP, SAMPLED_LP32)]
    assert w[1] == 1.2 and w[0] != w[2]
    assert grad.tolist() == pytest.approx([-x / 4 for x in w], abs=1e-12)


def test_the_logprob_gap_is_split_by_version_age():
    _, metrics, _ = _loss(AlgorithmConfig(ratio="behaviour"))
    # |trainer - sampler| = 0.1, 0.3 (age 1: version 3 under trainer 4), 0.0, 0.1 (age 0).
    assert metrics[gap_age_key(1)] == pytest.approx(0.2)
    assert metrics[gap_age_key(0)] == pytest.approx(0.05)
    assert metrics["logprob_gap/mean"] == pytest.approx(0.125)
    assert gap_age_key(0) == "logprob_gap/age_0"


def test_an_age_asked_for_but_absent_reports_zero():
    cfg = AlgorithmConfig(ratio="behaviour")
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    _, metrics = policy_loss(lp, None, torch.tensor([[-1.5, -2.0]]), torch.ones(1), torch.ones(1, 2), cfg,
                             token_ages=torch.zeros(1, 2, dtype=torch.long), ages=[0, 1])
    assert metrics[gap_age_key(0)] == pytest.approx(0.25) and metrics[gap_age_key(1)] == 0.0


# ------------------------------------------------------------------- staleness


def test_staleness_counts_from_the_oldest_token():
    c = _crossing()
    c.policy_version = 4  # even a label that disagrees: the tokens say 3
    assert oldest_version(c) == 3
    assert oldest_version(Completion([1], [-1.0], "stop", 5)) == 5


def test_drop_drops_the_whole_sample_and_counts_it():
    fresh = _episode(Completion([21, 22], [-0.3, -0.4], "stop", 4))
    out = filter_stale([_episode(_crossing()), fresh], min_version=4, mode="drop")
    assert out.kept == [fresh] and out.dropped == 1 and out.tokens_masked == 0


def test_mask_keeps_the_sample_and_masks_exactly_the_too_old_tokens():
    crossing = _episode(_crossing())
    out = filter_stale([crossing], min_version=4, mode="mask")
    assert out.kept == [crossing] and out.dropped == 0 and out.tokens_masked == 2
    batch = prepare_batch(out.kept, AlgorithmConfig(filter_zero_variance=False), max_tokens=8, pad_id=0,
                          trainer_version=4, min_version=4).batch
    assert batch is not None
    p = len(PROMPT)
    # Version-3 tokens stay in the row (context) but leave the loss; version-4 ones stay in it.
    assert batch.input_ids[0, p:].tolist() == TOKENS
    assert batch.attention_mask[0].tolist() == [1] * (p + 4)
    assert batch.loss_mask[0, p:].tolist() == [0, 0, 1, 1]
    assert tokens_by_age(batch) == {0: 2}


def test_mask_drops_a_sample_with_no_allowed_token_left():
    old = _episode(Completion([21, 22], [-0.3, -0.4], "stop", 2))
    out = filter_stale([old], min_version=4, mode="mask")
    assert out.kept == [] and out.dropped == 1 and out.tokens_masked == 0


def test_mask_counts_sampled_tokens_only_not_a_trajectorys_environment_tokens():
    # Turn 1 (version 3): 2 sampled tokens, then 2 environment tokens; turn 2 (version 4).
    traj = Completion([1, 2, 3, 4, 5], [-0.1, -0.2, 0.0, 0.0, -0.3], "stop", 3,
                      mask=[1, 1, 0, 0, 1], versions=[3, 3, 3, 3, 4])
    out = filter_stale([_episode(traj)], min_version=4, mode="mask")
    assert out.tokens_masked == 2 and out.dropped == 0
    batch = collate(out.kept, pad_id=0, min_version=4)
    assert batch.loss_mask[0, len(PROMPT):].tolist() == [0, 0, 0, 0, 1]


def test_nothing_is_stale_without_a_bound():
    old = _episode(Completion([21], [-0.3], "stop", 0))
    out = filter_stale([old], min_version=None, mode="drop")
    assert out.kept == [old] and out.dropped == 0


def test_age_counts_keep_every_allowed_age_as_a_key():
    assert age_counts({0: 5}, 2) == {0: 5, 1: 0, 2: 0}
    assert list(age_counts({3: 1, 0: 2}, 1).items()) == [(0, 2), (1, 0), (3, 1)]


# ------------------------------------------------------------------- the loop


class CrossingGenerator(FakeGenerator):
    """Every completion ran across an update: its first two tokens were sampled by the
    version before the one it serves (from version 1 on), the rest by the served one."""

    async def generate(self, requests):
        v = self.sampled_version()
        out = []
        for r in requests:
            comps = []
            for i in range(r.n):
                n = i + 3
                versions = [max(v - 1, 0)] * 2 + [v] * (n - 2)
                comps.append(Completion([5] * n, [-0.5] * n, "stop", min(versions), "x" * n, versions=versions))
            out.append(comps)
        return out


def _trained_tokens(trainer) -> list[int]:
    return [int(b.loss_mask.sum()) for b in trainer.batches]


def test_the_loop_drops_samples_whose_oldest_token_is_too_stale(tmp_path):
    _, rows, trainer, _ = run_loop(tmp_path, CrossingGenerator(), steps=3, stale_samples="drop")
    per_step = PROMPTS * GROUP
    assert [r["samples/dropped_stale"] for r in rows] == [0, per_step, per_step]
    assert [r["staleness/tokens_masked"] for r in rows] == [0, 0, 0]
    # Step 1 trains on version 0's samples (nothing older exists); steps 2 and 3 on nothing.
    assert len(trainer.batches) == 1
    assert [r["staleness/tokens_age_0"] for r in rows] == [_trained_tokens(trainer)[0], 0, 0]
    assert rows[1]["staleness/mean"] == 1, "counted from the oldest token"


def test_the_loop_masks_the_too_old_tokens_and_trains_on_the_rest(tmp_path):
    _, rows, trainer, _ = run_loop(tmp_path, CrossingGenerator(), steps=3, stale_samples="mask")
    per_step = PROMPTS * GROUP
    assert [r["samples/dropped_stale"] for r in rows] == [0, 0, 0]
    assert [r["samples/trained"] for r in rows] == [per_step] * 3
    # Two tokens of every sample are a version too old from step 2 on.
    assert [r["staleness/tokens_masked"] for r in rows] == [0, 2 * per_step, 2 * per_step]
    lengths = [i + 3 for i in range(GROUP)] * PROMPTS
    assert _trained_tokens(trainer) == [sum(lengths), sum(lengths) - 2 * per_step, sum(lengths) - 2 * per_step]
    assert [r["staleness/tokens_age_0"] for r in rows] == _trained_tokens(trainer)
    for step, batch in enumerate(trainer.batches):
        assert batch.trainer_version == step
        assert batch.token_versions is not None
        prompt = 3  # FakeTokenizer's prompt ids
        for row in range(batch.size):
            n = int(batch.attention_mask[row].sum()) - prompt
            mask = batch.loss_mask[row, prompt : prompt + n].tolist()
            # Exactly the older version's tokens leave the loss; all stay in the row.
            assert mask == ([1.0] * n if step == 0 else [0.0, 0.0] + [1.0] * (n - 2)), (step, row)
            assert batch.token_versions[row, prompt : prompt + 2].tolist() == [max(step - 1, 0)] * 2


def test_a_bad_stale_samples_value_is_refused():
    from pydantic import ValidationError

    from forgerl.configuration.config import RunConfig

    with pytest.raises(ValidationError, match="stale_samples"):
        RunConfig.model_validate({"loop": {"stale_samples": "trim"}})


# ------------------------------------------------------------------- the trainer


def test_the_trainer_reports_the_gap_by_age_over_micro_batches_and_its_token_counts(tiny_model_dir, tmp_path):
    """The fsdp trainer (one rank, one row per micro-batch): each ``logprob_gap/age_{a}`` is
    the mean over that age's tokens of the whole batch, not a mean of micro-batch means."""
    import dataclasses

    from tests.helpers import trainer_worker as worker

    batch = worker.make_batch(tiny_model_dir, rows=4, seed=5, length=14)
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=1)
    try:
        before = trainer.logprobs(batch)
        noise = 0.2 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
        behaviour = (before + noise) * batch.loss_mask
        # Trained at version 5: row 0 all version 5 (age 0); the other rows' first two
        # completion tokens version 4 (age 1, as if sampled before an update), rest age 0.
        versions = torch.full(batch.input_ids.shape, 5, dtype=torch.long)
        for row in range(1, batch.size):
            first = int(batch.loss_mask[row].nonzero()[0])
            versions[row, first : first + 2] = 4
        batch = dataclasses.replace(batch, behaviour_logprobs=behaviour, token_versions=versions, trainer_version=5)
        metrics = trainer.train_step(batch)
    finally:
        trainer.close()
    ages = 5 - versions
    gap = (before - behaviour).abs()
    on = batch.loss_mask != 0
    for age in (0, 1):
        want = float(gap[on & (ages == age)].mean())
        assert metrics[gap_age_key(age)] == pytest.approx(want, rel=1e-4), age
    assert metrics["logprob_gap/mean"] == pytest.approx(float(gap[on].mean()), rel=1e-4)
    assert tokens_by_age(batch) == {0: int(on.sum()) - 2 * (batch.size - 1), 1: 2 * (batch.size - 1)}
