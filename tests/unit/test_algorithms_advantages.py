"""Group advantages and zero-variance filtering against plain-Python references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forgerl.algorithms import group_advantages, zero_variance_groups

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------- references


def ref_advantages(rewards: list[float], groups: list[int], mode: str, eps: float) -> list[float]:
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        members.setdefault(g, []).append(r)

    def std(xs: list[float]) -> float:
        if len(xs) < 2:
            return 0.0
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    out = []
    for r, g in zip(rewards, groups):
        if max(members[g]) == min(members[g]):
            out.append(0.0)  # documented: exactly 0, whatever sum/len rounds to
            continue
        mean = sum(members[g]) / len(members[g])
        if mode == "group":
            out.append((r - mean) / (std(members[g]) + eps))
        elif mode == "batch":
            out.append((r - mean) / (std(rewards) + eps))
        else:
            out.append(r - mean)
    return out


def ref_zero_variance(rewards: list[float], groups: list[int]) -> tuple[list[bool], int]:
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        members.setdefault(g, []).append(r)
    flat = {g for g, xs in members.items() if max(xs) == min(xs)}
    return [g not in flat for g in groups], len(flat)


# ------------------------------------------------------------------- strategies

# Rewards from a small set so ties (and all-equal groups) are common.
reward = st.one_of(st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.25, 0.1]), st.floats(-10, 10))
grid = st.integers(1, 5).flatmap(lambda k: st.lists(st.lists(reward, min_size=k, max_size=k), min_size=1, max_size=5))
ragged = st.lists(st.lists(reward, min_size=1, max_size=6), min_size=1, max_size=6)
modes = st.sampled_from(["group", "batch", "none"])


def _flatten_shuffled(groups: list[list[float]], seed: int) -> tuple[list[float], list[int]]:
    # Arbitrary, non-contiguous ids in shuffled order: the function must not assume layout.
    pairs = [(r, 1000 + 7 * g) for g, xs in enumerate(groups) for r in xs]
    random.Random(seed).shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs]


@FAST
@given(grid, modes)
def test_grid_layout_matches_reference(rows, mode):
    rewards = torch.tensor(rows, dtype=torch.float64)
    got = group_advantages(rewards, std_normalize=mode, eps=1e-6)
    flat = [r for row in rows for r in row]
    gid = [g for g, row in enumerate(rows) for _ in row]
    want = ref_advantages(flat, gid, mode, 1e-6)
    assert got.shape == rewards.shape
    assert got.reshape(-1).tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


@FAST
@given(ragged, modes, st.integers(0, 10_000))
def test_ragged_shuffled_ids_match_reference(groups, mode, seed):
    flat, gid = _flatten_shuffled(groups, seed)
    got = group_advantages(torch.tensor(flat, dtype=torch.float64), torch.tensor(gid), std_normalize=mode, eps=1e-3)
    assert got.tolist() == pytest.approx(ref_advantages(flat, gid, mode, 1e-3), rel=1e-12, abs=1e-12)


@FAST
@given(ragged, st.integers(0, 10_000))
def test_advantages_sum_to_zero_within_each_group(groups, seed):
    flat, gid = _flatten_shuffled(groups, seed)
    adv = group_advantages(torch.tensor(flat, dtype=torch.float64), torch.tensor(gid))
    for g in set(gid):
        assert sum(a for a, i in zip(adv.tolist(), gid) if i == g) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_group_gives_exactly_zero(mode, dtype):
    # 0.1 * 5 is the interesting one: sum / count does not give back exactly 0.1.
    rewards = torch.tensor([[0.1] * 5, [1.0, 0.0, 1.0, 1.0, 0.3], [3.0] * 5, [0.7] * 5], dtype=dtype)
    adv = group_advantages(rewards, std_normalize=mode)
    for g in (0, 2, 3):
        assert torch.equal(adv[g], torch.zeros(5, dtype=dtype)), adv[g]
    assert (adv[1] != 0).all()
    ragged = group_advantages(torch.tensor([0.1] * 7 + [0.3, 0.2], dtype=dtype), torch.tensor([4] * 7 + [9, 9]))
    assert (ragged[:7] == 0).all() and (ragged[7:] != 0).all()


def test_known_values_and_dtype():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), eps=0.0 + 1e-12)
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.8660
    assert adv.dtype == torch.float32
    assert adv.tolist()[0] == pytest.approx([0.8660254, -0.8660254, 0.8660254, -0.8660254], rel=1e-6)
    # A group of one has no spread: advantage 0, not NaN.
    single = group_advantages(torch.tensor([5.0, 1.0, 2.0]), torch.tensor([0, 1, 1]))
    assert single.tolist()[0] == 0.0 and not torch.isnan(single).any()


def test_batch_std_differs_from_group_std():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 10.0]], dtype=torch.float64)
    g = group_advantages(rewards, std_normalize="group")
    b = group_advantages(rewards, std_normalize="batch")
    assert g[0, 1].item() == pytest.approx(g[1, 1].item(), rel=1e-4)  # group std hides the scale
    assert b[1, 1] > 5 * b[0, 1]  # batch std keeps it


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match="\\[G, K\\]"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="match"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[0.0, float("nan")]]))


@FAST
@given(ragged, st.integers(0, 10_000))
def test_zero_variance_groups_match_reference(groups, seed):
    flat, gid = _flatten_shuffled(groups, seed)
    res = zero_variance_groups(torch.tensor(flat, dtype=torch.float64), torch.tensor(gid))
    keep, dropped = ref_zero_variance(flat, gid)
    assert res.keep.tolist() == keep
    assert res.num_dropped_groups == dropped
    assert res.num_groups == len(groups)


def test_zero_variance_grid_and_tolerance():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.5, 0.5 + 1e-9, 0.5]], dtype=torch.float64)
    keep, dropped, total = zero_variance_groups(rewards)
    assert keep.tolist() == [[False] * 3, [True] * 3, [True] * 3] and (dropped, total) == (1, 3)
    keep, dropped, _ = zero_variance_groups(rewards, atol=1e-6)
    assert keep[2].tolist() == [False] * 3 and dropped == 2
