"""Episodes → TrainBatch: alignment of tokens, masks and sampling logprobs; advantages."""

from __future__ import annotations

import pytest
import torch

from forgerl.algorithms import AlgorithmConfig
from forgerl.runloop.batching import collate, prepare_batch
from forgerl.types import Completion, Episode, Problem

P = Problem(id="p", prompt="x")


def ep(group, prompt, tokens, reward, finish="stop"):
    return Episode(
        problem=P,
        group_id=group,
        prompt_token_ids=prompt,
        completion=Completion(tokens, [-0.1 * (i + 1) for i in range(len(tokens))], finish, policy_version=3),
        reward=reward,
    )


def test_collate_aligns_completion_tokens_logprobs_and_mask():
    b = collate([ep(0, [5, 6], [7, 8, 9], 1.0), ep(0, [5], [7], 0.0)], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert b.behaviour_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert b.behaviour_logprobs[1].tolist() == pytest.approx([0, -0.1, 0, 0, 0])
    assert b.policy_versions.tolist() == [3, 3]


def test_group_relative_advantages_per_group():
    eps = [ep(0, [1], [2], r) for r in (1.0, 0.0)] + [ep(1, [1], [2], r) for r in (0.5, 0.5)]
    prepared = prepare_batch(eps, AlgorithmConfig(std_normalize="none"), max_tokens=8, pad_id=0)
    assert prepared.batch.advantages.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert prepared.filtered_groups == 0


def test_zero_variance_groups_are_filtered_and_counted():
    eps = [ep(0, [1], [2], r) for r in (1.0, 0.0)] + [ep(1, [1], [2], r) for r in (0.5, 0.5)]
    cfg = AlgorithmConfig(std_normalize="none", filter_zero_variance=True)
    prepared = prepare_batch(eps, cfg, max_tokens=8, pad_id=0)
    assert prepared.filtered_groups == 1 and prepared.batch.size == 2
    assert prepared.batch.advantages.tolist() == pytest.approx([0.5, -0.5])


def test_overlong_mask_drops_truncated_rows_from_the_loss():
    eps = [ep(0, [1], [2, 3], 1.0, finish="length"), ep(0, [1], [2], 0.0)]
    prepared = prepare_batch(eps, AlgorithmConfig(overlong="mask"), max_tokens=2, pad_id=0)
    assert torch.equal(prepared.batch.loss_mask[0], torch.zeros(3))
    assert prepared.batch.loss_mask[1].sum() == 1
