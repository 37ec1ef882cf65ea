"""The GRPO-family policy loss: clipped surrogate, importance ratios, KL, aggregation.

All functions take padded ``[B, T]`` tensors and a ``mask`` ``[B, T]`` that is nonzero
on completion tokens that count. Masked-out positions may hold anything, even NaN or
inf: every value is passed through ``torch.where(mask, x, 0)`` *before* any nonlinear
op, so padding changes neither the loss nor its gradient (a multiply by the mask would
turn ``0 * inf`` into NaN). The maths, with the config key of every symbol, is in
``docs/algorithms.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .config import AlgorithmConfig

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_norm"]

#: The keys :func:`policy_loss` reports (``kl/ref`` only with ``ref_logprobs``,
#: ``logprob_gap/*`` only with ``behaviour_logprobs``, ``entropy`` only with ``entropy``;
#: with ``token_ages`` also ``logprob_gap/age_{a}``, see :func:`gap_age_key`).
METRIC_KEYS: tuple[str, ...] = (
    "loss/policy",
    "loss/kl",
    "clip/low_frac",
    "clip/high_frac",
    "kl/approx",
    "kl/ref",
    "ratio/mean",
    "ratio/max",
    "logprob_gap/mean",
    "logprob_gap/max",
    "entropy",
)


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    mask = mask != 0
    return _masked(x, mask).sum() / mask.sum().clamp(min=1)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over ``mask`` (0 when the mask is empty), without a host sync."""
    if x.numel() == 0:
        return x.new_zeros(())
    mx = torch.where(mask, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device)).max()
    return torch.where(mask.any(), mx, torch.zeros_like(mx))


class Surrogate(NamedTuple):
    """Per-token pieces of the clipped objective (all ``[B, T]``)."""

    objective: Tensor  # to be maximised
    ratio: Tensor
    low_clipped: Tensor  # bool: gradient stopped by the lower clip (A < 0, r < 1 - eps_low)
    high_clipped: Tensor  # bool: gradient stopped by the upper clip (A > 0, r > 1 + eps_high)


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO's ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, per token.

    With ``dual_clip = c > 1`` the objective of a negative-advantage token is also
    bounded below by ``c A`` (Ye et al., 2020): without it a token whose ratio has grown
    huge contributes an unbounded ``r A``. ``log_ratio`` and ``advantages`` must already be
    finite (the caller masks padding).
    """
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (advantages < 0)
        high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return Surrogate(objective, ratio, low, high)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    With ``log r = log pi_ref - log pi_theta`` (Schulman, "Approximating KL divergence"):
    k1 = -log r (unbiased, high variance, can be negative); k2 = (log r)^2 / 2 (biased,
    low variance); k3 = (r - 1) - log r (unbiased, low variance, always >= 0).
    """
    return kl_from_log_ratio(ref_logprobs - logprobs, estimator)


def kl_from_log_ratio(log_r: Tensor, estimator: Literal["k1", "k2", "k3"]) -> Tensor:
    """:func:`kl_estimate` given ``log r = log pi_ref - log pi_theta`` directly."""
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r  # expm1: exact near r = 1, where it matters
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: LossAgg,
    norm_constant: int | None = None,
    global_count: float | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    ``S`` is the set of rows with at least one mask token (fully masked rows, e.g.
    overlong-filtered or padding rows, do not count as sequences), ``|o_i|`` the number
    of mask tokens of row i, ``C`` the ``norm_constant``:

    - token_mean:          sum_i sum_t l_it / sum_i |o_i|          (DAPO)
    - seq_mean_token_mean: 1/|S| sum_i (1/|o_i|) sum_t l_it        (GRPO, GSPO)
    - seq_mean_token_sum:  1/|S| sum_i sum_t l_it
    - constant_norm:       1/(|S| C) sum_i sum_t l_it              (Dr. GRPO)

    ``global_count`` replaces the per-call count (tokens for token_mean, sequences for
    the others) so that micro-batch losses of one optimizer batch *sum* to its loss.
    """
    mask = mask != 0
    tokens_per_row = mask.sum(-1)
    row_sum = _masked(per_token, mask).sum(-1)
    if mode == "token_mean":
        denom = tokens_per_row.sum().clamp(min=1) if global_count is None else global_count
        return row_sum.sum() / denom
    n_seq = (tokens_per_row > 0).sum().clamp(min=1) if global_count is None else global_count
    if mode == "seq_mean_token_mean":
        return (row_sum / tokens_per_row.clamp(min=1)).sum() / n_seq
    if mode == "seq_mean_token_sum":
        return row_sum.sum() / n_seq
    if mode == "constant_norm":
        if norm_constant is None or not norm_constant >= 1:
            raise ValueError(
                f"constant_norm needs norm_constant >= 1 (config loss_norm_constant), got {norm_constant}"
            )
        return row_sum.sum() / (n_seq * norm_constant)
    raise ValueError(
        f"unknown loss_agg {mode!r}; expected 'token_mean', 'seq_mean_token_mean', "
        "'seq_mean_token_sum' or 'constant_norm'"
    )


def _gap_tensors(trainer_lp: Tensor, sampler_lp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    mask = mask != 0
    gap = _masked((trainer_lp.detach() - sampler_lp.detach()).abs(), mask)
    return masked_mean(gap, mask), _masked_max(gap, mask)


def gap_age_key(age: int) -> str:
    """The metric of the mean logprob gap over tokens sampled ``age`` versions before the
    trained weights."""
    return f"logprob_gap/age_{age}"


def logprob_gap_by_age(
    trainer_lp: Tensor, sampler_lp: Tensor, mask: Tensor, token_ages: Tensor, ages: Sequence[int]
) -> dict[str, Tensor]:
    """Mean ``|trainer logprob - sampler logprob|`` over the masked tokens of each age in
    ``ages`` (0 for an age without tokens), keyed by :func:`gap_age_key`.

    Each token is compared with its *own* sampling logprob, whatever version sampled it: a
    gap that grows with age is the policy moving; one at age 0 is train/inference mismatch.
    """
    mask = mask != 0
    gap = _masked((trainer_lp.detach() - sampler_lp.detach()).abs(), mask)
    return {gap_age_key(a): masked_mean(gap, mask & (token_ages == a)) for a in ages}


def logprob_gap(trainer_lp: Tensor, sampler_lp: Tensor, mask: Tensor) -> tuple[float, float]:
    """(mean, max) of ``|trainer logprob - sampler logprob|`` over masked tokens.

    The sampler (e.g. vLLM, different kernels and precision) and the trainer never agree
    exactly; a growing gap is the early sign of train/inference mismatch.
    """
    mean, mx = _gap_tensors(trainer_lp, sampler_lp, mask)
    return float(mean), float(mx)


def _check_shapes(logprobs: Tensor, mask: Tensor, advantages: Tensor, **others: Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match logprobs {tuple(logprobs.shape)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    behaviour_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: AlgorithmConfig,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    global_count: float | None = None,
    token_ages: Tensor | None = None,
    ages: Sequence[int] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss to minimise for one (micro-)batch, and its metrics.

    ``logprobs``: current policy, with grad. ``old_logprobs``: recomputed by the trainer
    before the update (needed when ``config.ratio == "old"``). ``behaviour_logprobs``:
    the sampler's (needed when ``config.ratio`` is ``"behaviour"`` or ``"auto"``, or ``tis_cap`` is set; if
    given, the ``logprob_gap/*`` metrics are always reported). ``advantages``: ``[B]`` per
    sequence or ``[B, T]`` per token. ``ref_logprobs``: reference model (needed when
    ``kl_coef > 0``). ``entropy``: per-token entropy, only logged. ``global_count``: see
    :func:`aggregate_loss`. Old, behaviour, reference logprobs and advantages are
    treated as constants.

    Every token is its own: the behaviour ratio and the truncated-IS weight of token ``t``
    use ``behaviour_logprobs[t]``, the logprob of whichever policy version sampled it, so a
    sample whose tokens come from several versions is weighted token by token.
    ``token_ages`` (``[B, T]``, versions between the trained weights and each token's
    sampler) adds the gap per age, ``logprob_gap/age_{a}`` for each of ``ages`` (default:
    the ages present under the mask; a trainer that sums metrics over micro-batches passes
    the same ``ages`` to every call).
    """
    _check_shapes(logprobs, mask, advantages, old_logprobs=old_logprobs,
                  behaviour_logprobs=behaviour_logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
                  token_ages=token_ages)
    m = mask != 0
    # 'auto' is resolved by the trainer, which knows its precision (AlgorithmConfig.ratio);
    # a config that reaches here unresolved means a trainer computing like the sampler.
    if config.effective_ratio() == "behaviour":
        if behaviour_logprobs is None:
            raise ValueError("ratio='behaviour' needs behaviour_logprobs (the sampler's), got None")
        base = behaviour_logprobs.detach()
    else:
        if old_logprobs is None:
            raise ValueError("ratio='old' needs old_logprobs (recomputed before the update), got None")
        base = old_logprobs.detach()

    token_log_ratio = _masked(logprobs - base, m)
    if config.sequence_level_ratio:
        # GSPO: s_i = exp(mean_t log r_it), the geometric mean of the token ratios. We use
        # the GSPO-token form log s_it = sg[log s_i] + log p_it - sg[log p_it]: its value is
        # s_i at every token, and averaged over the tokens of a sequence (seq_mean_token_mean)
        # its gradient is exactly that of s_i, s_i * mean_t grad log p_it.
        seq_log_ratio = token_log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
        log_ratio = _masked(seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach(), m)
    else:
        log_ratio = token_log_ratio

    adv = advantages.detach()
    adv = adv.unsqueeze(-1).expand_as(logprobs) if adv.dim() == 1 else adv
    adv = _masked(adv.to(logprobs.dtype), m)

    surr = clipped_surrogate(log_ratio, adv, config.clip_low, config.clip_high, config.dual_clip)
    per_token = -surr.objective
    if config.tis_cap is not None:
        # Truncated IS (ratio='old' only, enforced by the config): the clipped ratio is
        # pi_theta / pi_old, but the tokens were sampled by the inference engine, so each
        # token is reweighted by the detached, capped pi_old / pi_behaviour.
        if behaviour_logprobs is None:
            raise ValueError("tis_cap needs behaviour_logprobs (the sampler's), got None")
        tis_log = _masked(base - behaviour_logprobs.detach(), m)
        per_token = per_token * torch.exp(tis_log).clamp(max=config.tis_cap)
    loss_policy = aggregate_loss(per_token, m, config.loss_agg, config.loss_norm_constant, global_count)

    zero = logprobs.new_zeros(())
    loss_kl, kl_ref = zero, None
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (set kl_coef: 0 to run without a reference model)")
    if ref_logprobs is not None:
        # Mask the difference, not the estimate: exp() of garbage would be inf.
        log_r = _masked(ref_logprobs.detach() - logprobs, m)
        kl_tok = _masked(kl_from_log_ratio(log_r, config.kl_estimator), m)
        kl_ref = masked_mean(kl_tok.detach(), m)
        if config.kl_coef > 0:
            loss_kl = config.kl_coef * aggregate_loss(kl_tok, m, config.loss_agg, config.loss_norm_constant, global_count)
    loss = loss_policy + loss_kl

    with torch.no_grad():
        ratio = surr.ratio
        lr = token_log_ratio.detach()
        values: dict[str, Tensor] = {
            "loss/policy": loss_policy.detach(),
            "loss/kl": loss_kl.detach(),
            "clip/low_frac": masked_mean(surr.low_clipped.to(logprobs.dtype), m),
            "clip/high_frac": masked_mean(surr.high_clipped.to(logprobs.dtype), m),
            # k3 of pi_base / pi_theta per token: how far this update has moved the policy.
            "kl/approx": masked_mean(torch.expm1(-lr) + lr, m),
            "ratio/mean": masked_mean(ratio, m),
            "ratio/max": _masked_max(ratio, m),
        }
        if kl_ref is not None:
            values["kl/ref"] = kl_ref
        if behaviour_logprobs is not None:
            values["logprob_gap/mean"], values["logprob_gap/max"] = _gap_tensors(logprobs, behaviour_logprobs, m)
            if token_ages is not None:
                if ages is None:
                    ages = torch.unique(token_ages[m]).tolist()
                values.update(logprob_gap_by_age(logprobs, behaviour_logprobs, m, token_ages, ages))
        if entropy is not None:
            values["entropy"] = masked_mean(_masked(entropy.detach(), m), m)
        # One device->host copy for all metrics instead of one sync per .item().
        keys = list(values)
        numbers = torch.stack([values[k].to(torch.float64) for k in keys]).tolist()
    return loss, dict(zip(keys, numbers))
