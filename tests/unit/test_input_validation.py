"""Bad input to the loss, the batch types and the fsdp trainer is refused with a
ValueError that says what was expected, also under ``python -O`` (which strips asserts)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forgerl.algorithms import AlgorithmConfig
from forgerl.algorithms.loss import aggregate_loss, clipped_surrogate, kl_from_log_ratio, policy_loss
from forgerl.types import Completion, TrainBatch
from forgerl_plugins.trainers.shared.batching import check_batch as _check_batch
from forgerl_plugins.trainers.shared.batching import micro_batches, rank_rows
from tests.helpers.timing import scaled


def test_a_completion_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="one logprob per token: got 3 token ids but 2 logprobs"):
        Completion([1, 2, 3], [-0.1, -0.2], "stop", policy_version=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip_low=1.0, clip_high=0.2), r"clip_low must be in \[0, 1\), got 1.0"),
        (dict(clip_low=0.2, clip_high=-0.1), "clip_high must be >= 0, got -0.1"),
        (dict(clip_low=0.2, clip_high=0.2, dual_clip=0.5), "dual_clip must be None or > 1, got 0.5"),
    ],
)
def test_clipped_surrogate_refuses_bad_clip_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        clipped_surrogate(torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_unknown_modes_name_the_expected_ones():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; expected 'k1', 'k2' or 'k3'"):
        kl_from_log_ratio(torch.zeros(2), "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'; expected 'token_mean'"):
        aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_constant >= 1 .*got 0"):
        aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "constant_norm", 0)


def test_policy_loss_refuses_missing_or_misshapen_logprobs():
    lp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2)
    tis = AlgorithmConfig(ratio="old", tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap needs behaviour_logprobs"):
        policy_loss(lp, lp, None, adv, mask, tis)
    with pytest.raises(ValueError, match=r"ref_logprobs \(2, 2\) must match logprobs \(2, 3\)"):
        policy_loss(lp, None, lp, adv, mask, AlgorithmConfig(), ref_logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        policy_loss(torch.zeros(3), None, torch.zeros(3), adv, torch.ones(3), AlgorithmConfig())


def test_fsdp_batching_refuses_impossible_shares():
    with pytest.raises(ValueError, match="rank 2 out of range for world size 2"):
        rank_rows(4, 2, 2)
    with pytest.raises(ValueError, match="empty batch .*got batch size 0"):
        micro_batches(0, 1, 0, 2)
    with pytest.raises(ValueError, match="3 lengths for a batch of 4: expected one length per row"):
        micro_batches(4, 1, 0, 2, [1, 2, 3])


def _batch(**over) -> TrainBatch:
    fields = dict(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4),
        loss_mask=torch.ones(2, 4),
        behaviour_logprobs=torch.zeros(2, 4),
        advantages=torch.zeros(2),
        policy_versions=torch.zeros(2, dtype=torch.long),
    )
    return TrainBatch(**{**fields, **over})


def test_fsdp_trainer_refuses_a_misshapen_batch():
    _check_batch(_batch())  # well formed: no error
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\] with B >= 1, got \(0, 4\)"):
        _check_batch(_batch(input_ids=torch.zeros(0, 4, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 3\), expected input_ids' \(2, 4\)"):
        _check_batch(_batch(loss_mask=torch.ones(2, 3)))
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\]"):
        _check_batch(_batch(advantages=torch.zeros(3)))


def test_refusals_survive_python_optimise_mode():
    # `python -O` strips assert statements; these checks must not be asserts.
    code = (
        "import torch\n"
        "from forgerl.algorithms.loss import clipped_surrogate\n"
        "from forgerl.types import Completion\n"
        "from forgerl_plugins.trainers.shared.batching import rank_rows\n"
        "calls = [lambda: Completion([1], [], 'stop', 0),\n"
        "         lambda: clipped_surrogate(torch.zeros(1), torch.zeros(1), 2.0, 0.2),\n"
        "         lambda: rank_rows(4, 2, 5)]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError:\n"
        "        continue\n"
        "    raise SystemExit('accepted bad input under -O')\n"
        "print('refused')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stdout + proc.stderr[-2000:]
