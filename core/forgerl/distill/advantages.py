"""On-policy distillation as per-token advantages (pure functions over ``[B, T]`` tensors).

The student samples, the teacher scores the sampled tokens, and each token's advantage is
the negative of its sampled reverse KL term::

    A_t = -w_kl * clip(log p_student(x_t) - log p_teacher(x_t)) + w_reward * A_group

``log p_student`` is the sampler's own logprob of the token (the behaviour policy, the
``behaviour_logprobs`` of the batch), ``log p_teacher`` the teacher's logprob of the same
token in the same context. Its expectation over the student's samples is the reverse KL
``KL(student || teacher)``: maximising ``sum_t A_t`` through the policy-gradient loss pulls
the student toward the teacher on the tokens it actually writes (mode-seeking), one signal
per token instead of one per sequence. ``A_group`` is the task's group-relative advantage
of the sample (``[B]``, the same for every token of a row), mixed in by ``w_reward``.

The result goes through the usual loss (:func:`forgerl.algorithms.policy_loss`: importance
ratio, clipping, aggregation), which takes ``[B, T]`` advantages as constants.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def reverse_kl_terms(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log p_student - log p_teacher`` per sampled token (``[B, T]``), 0 outside ``mask``.

    Masked-out positions may hold anything (padding, a failed teacher's NaN): they are
    replaced before the subtraction, so nothing leaks into the result."""
    m = mask != 0
    return _masked(_masked(student_logprobs, m) - _masked(teacher_logprobs, m), m)


def distill_advantages(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_weight: float = 1.0,
    kl_clip: float | None = None,
    reward_advantages: Tensor | None = None,
    reward_weight: float = 0.0,
) -> Tensor:
    """Per-token advantages ``[B, T]`` (see the module docstring), 0 outside ``mask``.

    ``kl_clip`` bounds each token's ``|log p_student - log p_teacher|`` before weighting
    (None: no bound). ``reward_advantages`` (``[B]``) is mixed in with ``reward_weight``;
    it is needed only when that weight is not 0."""
    if student_logprobs.dim() != 2 or teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(
            f"student and teacher logprobs must both be [B, T]: got {tuple(student_logprobs.shape)} "
            f"and {tuple(teacher_logprobs.shape)}"
        )
    if mask.shape != student_logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match the logprobs {tuple(student_logprobs.shape)}")
    if kl_clip is not None and not kl_clip > 0:
        raise ValueError(f"kl_clip must be None or > 0, got {kl_clip}")
    m = mask != 0
    terms = reverse_kl_terms(student_logprobs.float(), teacher_logprobs.float(), m)
    if kl_clip is not None:
        terms = terms.clamp(-kl_clip, kl_clip)
    advantages = -kl_weight * terms
    if reward_weight != 0:
        if reward_advantages is None or reward_advantages.shape != student_logprobs.shape[:1]:
            raise ValueError(
                f"reward_weight {reward_weight} needs reward_advantages of shape {tuple(student_logprobs.shape[:1])}, "
                f"got {None if reward_advantages is None else tuple(reward_advantages.shape)}"
            )
        advantages = advantages + reward_weight * reward_advantages.float().unsqueeze(-1)
    return _masked(advantages, m)


def reverse_kl_mean(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> float:
    """Mean of ``log p_student - log p_teacher`` over the masked tokens (unclipped): the
    sampled estimate of the per-token reverse KL to the teacher (0 for an empty mask)."""
    m = mask != 0
    terms = reverse_kl_terms(student_logprobs.float(), teacher_logprobs.float(), m)
    return float(terms.sum() / m.sum().clamp(min=1))


def agreement(sampled_ids: Tensor, teacher_top1: Tensor, mask: Tensor) -> float | None:
    """Fraction of the masked tokens the teacher would have picked greedily (the sampled id
    equals the teacher's most likely id there); positions where ``teacher_top1`` is negative
    (the teacher did not say) do not count. None when no position counts."""
    m = (mask != 0) & (teacher_top1 >= 0)
    counted = int(m.sum())
    if counted == 0:
        return None
    return float(((sampled_ids == teacher_top1) & m).sum()) / counted
