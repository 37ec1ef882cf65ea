"""Group-relative advantages (GRPO and variants) and zero-variance group filtering.

Rewards arrive either as a ``[G, K]`` tensor (G prompts, K completions each) or as a
flat ``[N]`` tensor with ``group_ids`` ``[N]`` (any integers; groups may have different
sizes and need not be contiguous). Results have the shape of ``rewards``.

    A_i = (r_i - mean(group(i))) / (std + std_eps)

``std`` is the unbiased (Bessel-corrected, as ``torch.std``) std of the sample's group
('group'), of all rewards in the batch ('batch', Lite PPO: group mean, batch std), or 1
with no eps ('none', Dr. GRPO). A group of one has std 0 and advantage 0.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

StdNormalize = Literal["group", "batch", "none"]


def _flatten_groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Return (flat rewards [N], dense group index [N] in 0..G-1, G)."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"without group_ids, rewards must be [G, K]; got shape {tuple(rewards.shape)}")
        g, k = rewards.shape
        index = torch.arange(g, device=rewards.device).repeat_interleave(k)
        return rewards.reshape(-1), index, g
    if rewards.dim() != 1:
        raise ValueError(f"with group_ids, rewards must be [N]; got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    # Arbitrary ids -> dense 0..G-1 so we can scatter into [G] buffers.
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max().item()) + 1 if index.numel() else 0
    return rewards, index, n_groups


def _group_stats(flat: Tensor, index: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std) as [G] tensors, float64."""
    count = torch.zeros(n_groups, dtype=flat.dtype, device=flat.device).index_add_(0, index, torch.ones_like(flat))
    total = torch.zeros_like(count).index_add_(0, index, flat)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, index, (flat - mean[index]) ** 2)
    # Bessel correction; a group of one has no spread (and would divide by zero).
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return count, mean, var.sqrt()


def _group_range(flat: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Per-group max - min, [G]."""
    gmax = flat.new_full((n_groups,), -torch.inf).scatter_reduce(0, index, flat, reduce="amax")
    gmin = flat.new_full((n_groups,), torch.inf).scatter_reduce(0, index, flat, reduce="amin")
    return gmax - gmin


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    std_normalize: StdNormalize = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: rewards centred on their group mean, optionally std-normalised.

    ``rewards``: ``[G, K]``, or ``[N]`` together with integer ``group_ids`` ``[N]``.
    Returns a tensor of the same shape and dtype as ``rewards`` (computed in float64).
    """
    if std_normalize not in ("group", "batch", "none"):
        raise ValueError(f"unknown std_normalize {std_normalize!r}; expected 'group', 'batch' or 'none'")
    if not (eps > 0 or std_normalize == "none"):
        raise ValueError(f"eps must be > 0 so zero-variance groups give 0, not NaN; got {eps}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    if rewards.numel() == 0:
        return rewards.clone()
    flat, index, n_groups = _flatten_groups(rewards, group_ids)
    flat64 = flat.to(torch.float64)
    if not torch.isfinite(flat64).all():
        raise ValueError("rewards must be finite (a failed reward should have a finite failure score)")
    _, mean, std = _group_stats(flat64, index, n_groups)
    # sum/count rounds: five copies of 0.1 have a mean that is not exactly 0.1, and the
    # ~1e-17 residue divided by (0 + eps) becomes ~1e-11. A group whose rewards are all
    # equal must give exactly 0 (no gradient at all), so set it explicitly.
    flat_group = _group_range(flat64, index, n_groups) == 0
    centred = torch.where(flat_group[index], 0.0, flat64 - mean[index])
    if std_normalize == "group":
        adv = centred / (std[index] + eps)
    elif std_normalize == "batch":
        batch_std = flat64.std() if flat64.numel() > 1 else flat64.new_zeros(())
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    return adv.to(rewards.dtype).reshape(rewards.shape)


class ZeroVarianceGroups(NamedTuple):
    """``keep`` has the shape of ``rewards``: False for samples of zero-variance groups."""

    keep: Tensor
    num_dropped_groups: int
    num_groups: int


def zero_variance_groups(rewards: Tensor, group_ids: Tensor | None = None, *, atol: float = 0.0) -> ZeroVarianceGroups:
    """Find groups whose rewards are all equal (max - min <= atol).

    Their advantages are all zero, so they add no policy gradient while still diluting
    token/sequence means; DAPO's dynamic sampling drops them (and samples more prompts
    until the batch is full). Uses max - min rather than the std so an exactly uniform
    group is found exactly, without floating-point fuzz.
    """
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    if rewards.numel() == 0:
        return ZeroVarianceGroups(torch.ones_like(rewards, dtype=torch.bool), 0, 0)
    flat, index, n_groups = _flatten_groups(rewards, group_ids)
    flat_group = _group_range(flat.to(torch.float64), index, n_groups) <= atol
    keep = (~flat_group[index]).reshape(rewards.shape)
    return ZeroVarianceGroups(keep, int(flat_group.sum().item()), n_groups)
