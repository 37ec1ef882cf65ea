"""policy_loss and friends against a plain-Python float64 reference, plus properties."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from forgerl.algorithms import (
    METRIC_KEYS,
    AlgorithmConfig,
    aggregate_loss,
    apply_overlong,
    clipped_surrogate,
    group_advantages,
    kl_estimate,
    logprob_gap,
    overlong_mask,
    policy_loss,
    soft_overlong_penalty,
)

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_norm"]

# ------------------------------------------------------------------- reference


def ref_policy_loss(lp, old, beh, adv, mask, cfg: AlgorithmConfig, ref=None) -> tuple[float, dict[str, float]]:
    """The documented formulas, one token at a time, in Python floats."""
    lp, mask = lp.tolist(), mask.tolist()
    old = old.tolist() if old is not None else None
    beh = beh.tolist() if beh is not None else None
    ref = ref.tolist() if ref is not None else None
    adv = adv.tolist()
    base = beh if cfg.ratio == "behaviour" else old
    B, T = len(lp), len(lp[0])
    loss_tok = [[0.0] * T for _ in range(B)]
    kl_tok = [[0.0] * T for _ in range(B)]
    low = high = 0
    ratios, approx, gaps, kls = [], [], [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        if cfg.sequence_level_ratio and toks:
            s = math.exp(sum(lp[i][t] - base[i][t] for t in toks) / len(toks))
        for t in toks:
            r = s if cfg.sequence_level_ratio else math.exp(lp[i][t] - base[i][t])
            a = adv[i] if isinstance(adv[i], float) else adv[i][t]
            clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            obj = min(r * a, clipped * a)
            if cfg.dual_clip is not None and a < 0:
                obj = max(obj, cfg.dual_clip * a)
            w = min(math.exp(old[i][t] - beh[i][t]), cfg.tis_cap) if cfg.tis_cap is not None else 1.0
            loss_tok[i][t] = -w * obj
            low += a < 0 and r < 1 - cfg.clip_low
            high += a > 0 and r > 1 + cfg.clip_high
            ratios.append(r)
            x = base[i][t] - lp[i][t]
            approx.append(math.exp(x) - 1 - x)
            if beh is not None:
                gaps.append(abs(lp[i][t] - beh[i][t]))
            if ref is not None:
                x = ref[i][t] - lp[i][t]
                kl_tok[i][t] = {"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - 1 - x}[cfg.kl_estimator]
                kls.append(kl_tok[i][t])

    def agg(vals):
        rows = [i for i in range(B) if any(mask[i])]
        if not rows:
            return 0.0
        n_tok = sum(sum(1 for t in range(T) if mask[i][t]) for i in rows)
        sums = {i: sum(vals[i][t] for t in range(T) if mask[i][t]) for i in rows}
        lens = {i: sum(1 for t in range(T) if mask[i][t]) for i in rows}
        if cfg.loss_agg == "token_mean":
            return sum(sums.values()) / n_tok
        if cfg.loss_agg == "seq_mean_token_mean":
            return sum(sums[i] / lens[i] for i in rows) / len(rows)
        if cfg.loss_agg == "seq_mean_token_sum":
            return sum(sums.values()) / len(rows)
        return sum(sums.values()) / (len(rows) * cfg.loss_norm_constant)

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    n = len(ratios)
    policy = agg(loss_tok)
    kl = cfg.kl_coef * agg(kl_tok) if cfg.kl_coef > 0 else 0.0
    metrics = {
        "loss/policy": policy,
        "loss/kl": kl,
        "clip/low_frac": low / n if n else 0.0,
        "clip/high_frac": high / n if n else 0.0,
        "kl/approx": mean(approx),
        "ratio/mean": mean(ratios),
        "ratio/max": max(ratios) if ratios else 0.0,
    }
    if ref is not None:
        metrics["kl/ref"] = mean(kls)
    if beh is not None:
        metrics["logprob_gap/mean"] = mean(gaps)
        metrics["logprob_gap/max"] = max(gaps) if gaps else 0.0
    return policy + kl, metrics


# ------------------------------------------------------------------ strategies


@st.composite
def configs(draw, kl: bool = True) -> AlgorithmConfig:
    ratio = draw(st.sampled_from(["behaviour", "old"]))
    kw = dict(
        preset=draw(st.sampled_from(["grpo", "dr_grpo", "dapo", "gspo"])),
        ratio=ratio,
        loss_agg=draw(st.sampled_from(AGGS)),
        loss_norm_constant=draw(st.integers(1, 9)),
        clip_low=draw(st.sampled_from([0.2, 0.1, 3e-4])),
        clip_high=draw(st.sampled_from([0.2, 0.28, 4e-4])),
        dual_clip=draw(st.sampled_from([None, 1.5, 3.0])),
        sequence_level_ratio=draw(st.booleans()),
    )
    if ratio == "old":
        kw["tis_cap"] = draw(st.sampled_from([None, 1.0, 2.0]))
    if kl:
        kw["kl_coef"] = draw(st.sampled_from([0.0, 0.04, 1.0]))
        kw["kl_estimator"] = draw(st.sampled_from(["k1", "k2", "k3"]))
    return AlgorithmConfig(**kw)


def make_batch(seed: int, b: int, t: int, *, token_adv: bool = False, noise: float = 0.3, p_mask: float = 0.7):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    lp = -3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    old = lp + noise * randn(b, t)
    beh = old + noise * randn(b, t)
    ref = lp + 0.5 * randn(b, t)
    adv = randn(b, t) if token_adv else randn(b)
    mask = (torch.rand(b, t, generator=g) < p_mask).to(torch.float64)
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64)
    return dict(lp=lp.requires_grad_(True), old=old, beh=beh, ref=ref, adv=adv, mask=mask, entropy=entropy)


def run(d, cfg, **kw):
    return policy_loss(d["lp"], d["old"], d["beh"], d["adv"], d["mask"], cfg, ref_logprobs=d["ref"], **kw)


batches = st.tuples(
    st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 6), st.booleans(), st.sampled_from([1e-4, 0.05, 0.3])
)

# ------------------------------------------------------------------------ tests


@FAST
@given(configs(), batches)
def test_matches_python_reference(cfg, batch):
    seed, b, t, token_adv, noise = batch
    d = make_batch(seed, b, t, token_adv=token_adv, noise=noise)
    loss, metrics = run(d, cfg, entropy=d["entropy"])
    want_loss, want_metrics = ref_policy_loss(d["lp"].detach(), d["old"], d["beh"], d["adv"], d["mask"], cfg, d["ref"])
    assert loss.item() == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    m = d["mask"].bool()
    assert metrics["entropy"] == pytest.approx(d["entropy"][m].mean().item() if m.any() else 0.0)
    assert set(metrics) == set(want_metrics) | {"entropy"}
    assert set(metrics) <= set(METRIC_KEYS)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), batches)
def test_gradcheck(cfg, batch):
    seed, b, t, token_adv, noise = batch
    # GSPO-token with per-token advantages or per-token TIS weights is deliberately not the
    # gradient of its value (each token keeps its own weight); check those elsewhere.
    token_adv = token_adv and not cfg.sequence_level_ratio
    if cfg.sequence_level_ratio and cfg.tis_cap is not None:
        cfg = cfg.model_copy(update={"tis_cap": None, "ratio": "old"})
    d = make_batch(seed, b, t, token_adv=token_adv, noise=noise)
    # The loss has kinks where a ratio meets a clip bound; a finite difference straddling
    # one disagrees with the (one-sided) analytical gradient, so keep draws away from them.
    assume(distance_to_kinks(d, cfg) > 1e-4)

    def f(lp):
        return policy_loss(lp, d["old"], d["beh"], d["adv"], d["mask"], cfg, ref_logprobs=d["ref"])[0]

    assert torch.autograd.gradcheck(f, (d["lp"],))


def distance_to_kinks(d, cfg: AlgorithmConfig) -> float:
    """How far (in ratio units) the batch's nearest ratio is from a clip bound."""
    base = d["beh"] if cfg.ratio == "behaviour" else d["old"]
    log_ratio = (d["lp"] - base).detach()
    mask = d["mask"].bool()
    if cfg.sequence_level_ratio:
        per_row = (log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)
        log_ratio = per_row[:, None].expand_as(log_ratio)
    ratios = log_ratio.exp()[mask]
    bounds = [1 - cfg.clip_low, 1 + cfg.clip_high] + ([cfg.dual_clip] if cfg.dual_clip is not None else [])
    if ratios.numel() == 0:
        return math.inf
    return min(float((ratios - bound).abs().min()) for bound in bounds)


GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 7.0]


@FAST
@given(configs(), batches, st.integers(0, 3), st.integers(0, 2), st.data())
def test_padding_changes_neither_loss_nor_gradient(cfg, batch, pad_t, pad_b, data):
    seed, b, t, token_adv, noise = batch
    d = make_batch(seed, b, t, token_adv=token_adv, noise=noise)
    loss, metrics = run(d, cfg)
    (grad,) = torch.autograd.grad(loss, d["lp"])

    def pad(x: torch.Tensor, fill_row: bool = True) -> torch.Tensor:
        junk = data.draw(st.sampled_from(GARBAGE))
        if x.dim() == 1:
            return torch.cat([x, torch.full((pad_b,), junk, dtype=x.dtype)])
        x = torch.cat([x, torch.full((x.shape[0], pad_t), junk, dtype=x.dtype)], dim=1)
        return torch.cat([x, torch.full((pad_b, x.shape[1]), junk, dtype=x.dtype)], dim=0)

    padded = {k: pad(v.detach()) for k, v in d.items() if k != "mask"}
    padded["mask"] = torch.zeros(b + pad_b, t + pad_t, dtype=torch.float64)
    padded["mask"][:b, :t] = d["mask"]
    padded["lp"].requires_grad_(True)
    loss_p, metrics_p = run(padded, cfg)
    (grad_p,) = torch.autograd.grad(loss_p, padded["lp"])
    assert loss_p.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad_p[:b, :t], grad, rtol=1e-12, atol=1e-14)
    assert (grad_p[b:] == 0).all() and (grad_p[:, t:] == 0).all()
    # Gradient on unmasked-out real tokens is zero too.
    assert (grad[d["mask"] == 0] == 0).all()
    assert metrics_p == pytest.approx(metrics, rel=1e-12, abs=1e-14)


@FAST
@given(configs(kl=False), st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 5),
       st.sampled_from(["group", "batch", "none"]))
def test_equal_rewards_give_zero_advantage_and_zero_gradient(cfg, seed, groups, k, mode):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups, 1, generator=g, dtype=torch.float64).expand(groups, k)
    adv = group_advantages(rewards, std_normalize=mode).reshape(-1)
    assert (adv == 0).all()
    d = make_batch(seed, groups * k, 5)
    d["adv"] = adv
    loss, _ = run(d, cfg)
    (grad,) = torch.autograd.grad(loss, d["lp"])
    assert loss.item() == 0.0
    assert (grad == 0).all()


def test_unequal_rewards_do_give_a_gradient():
    # Control for the test above: it would also pass if the loss ignored advantages.
    cfg = AlgorithmConfig()
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)).reshape(-1)
    d = make_batch(0, 4, 5, noise=1e-3, p_mask=1.0)
    d["adv"] = adv
    (grad,) = torch.autograd.grad(run(d, cfg)[0], d["lp"])
    assert (grad[adv > 0] < 0).all() and (grad[adv < 0] > 0).all()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.floats(-3, 3), min_size=1, max_size=8),
    st.floats(-5, 5).filter(lambda a: abs(a) > 1e-3),
    st.sampled_from([0.0, 0.2, 3e-4]),
    st.sampled_from([0.0, 0.28, 4e-4]),
    st.sampled_from([None, 1.5, 3.0]),
)
def test_clipping_bounds(log_ratios, a, clip_low, clip_high, dual):
    lr = torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True)
    adv = torch.full_like(lr, a)
    s = clipped_surrogate(lr, adv, clip_low, clip_high, dual)
    (grad,) = torch.autograd.grad(s.objective.sum(), lr)
    for x, obj, g, lo, hi in zip(log_ratios, s.objective.tolist(), grad.tolist(), s.low_clipped, s.high_clipped):
        r = math.exp(x)
        tol = 1e-12 * max(1.0, abs(r * a))
        dual_active = dual is not None and a < 0 and r * a < dual * a
        if not dual_active:
            assert obj <= r * a + tol  # pessimistic: never above the unclipped objective
        else:
            assert obj == pytest.approx(dual * a)  # the dual clip floors a negative-advantage loss
        if a > 0:
            assert obj <= (1 + clip_high) * a + tol
        else:
            assert obj <= (1 - clip_low) * a + tol
            if dual is not None:
                assert obj >= dual * a - tol
        assert bool(lo) == (a < 0 and r < 1 - clip_low)
        assert bool(hi) == (a > 0 and r > 1 + clip_high)
        if lo or hi or dual_active:
            assert g == 0.0  # the clip stops the push beyond the bound
        else:
            assert g == pytest.approx(r * a, rel=1e-12)


def test_clipped_tokens_get_no_gradient_in_policy_loss():
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    beh = torch.zeros(1, 4, dtype=torch.float64)
    # ratios 1.5 (above 1.28), 1.1, 0.5 (below 0.8), 0.9
    lp = torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5), math.log(0.9)]], dtype=torch.float64,
                      requires_grad=True)
    mask = torch.ones(1, 4)
    for a, zero in [(1.0, [True, False, False, False]), (-1.0, [False, False, True, False])]:
        loss, metrics = policy_loss(lp, None, beh, torch.tensor([a], dtype=torch.float64), mask, cfg)
        (grad,) = torch.autograd.grad(loss, lp)
        assert (grad[0] == 0).tolist() == zero
        assert metrics["clip/high_frac"] == (0.25 if a > 0 else 0.0)
        assert metrics["clip/low_frac"] == (0.25 if a < 0 else 0.0)


@FAST
@given(configs(), batches, st.integers(1, 3))
def test_micro_batches_sum_to_full_batch(cfg, batch, split):
    seed, b, t, token_adv, noise = batch
    d = make_batch(seed, b, t, token_adv=token_adv, noise=noise)
    full, _ = run(d, cfg)
    (grad,) = torch.autograd.grad(full, d["lp"])
    m = d["mask"] != 0
    count = float(m.sum()) if cfg.loss_agg == "token_mean" else float((m.sum(-1) > 0).sum())
    total, grads = 0.0, []
    for rows in torch.arange(b).tensor_split(min(split, b)):
        part = {k: v[rows].detach() for k, v in d.items()}
        part["lp"].requires_grad_(True)
        loss, _ = run(part, cfg, global_count=max(count, 1.0))
        total += loss.item()
        grads.append(torch.autograd.grad(loss, part["lp"])[0])
    assert total == pytest.approx(full.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), grad)


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_gspo_gradient_equals_direct_sequence_ratio(agg):
    # GSPO written directly: s_i = exp(mean_t log r_it) with autograd through the mean.
    cfg = AlgorithmConfig(preset="gspo", loss_agg=agg)
    d = make_batch(3, 8, 7, noise=6e-4, p_mask=0.8)
    m = d["mask"].bool()
    lp, beh, adv = d["lp"], d["beh"], d["adv"]
    lens = m.sum(-1).clamp(min=1)
    s = torch.exp(torch.where(m, lp - beh, 0.0).sum(-1) / lens)
    obj = torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    rows = m.any(-1)
    if agg == "seq_mean_token_mean":
        direct = -(obj * rows).sum() / rows.sum()
    else:
        direct = -(obj * m.sum(-1)).sum() / m.sum()
    (want,) = torch.autograd.grad(direct, lp)
    loss, metrics = policy_loss(lp, None, beh, adv, d["mask"], cfg)
    (got,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(direct.item(), rel=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert 0 < metrics["clip/low_frac"] + metrics["clip/high_frac"] < 1  # both regimes exercised


def test_tis_weights():
    d = make_batch(5, 3, 4, noise=0.5, p_mask=1.0)
    plain = AlgorithmConfig(ratio="old")
    tis = AlgorithmConfig(ratio="old", tis_cap=1.5)
    # Sampler == old policy: every weight is exactly 1.
    same = {**d, "beh": d["old"]}
    assert run(same, tis)[0].item() == pytest.approx(run(same, plain)[0].item(), rel=1e-14)
    # Otherwise the weights are min(pi_old / pi_b, cap): the loss changes and old/beh get no grad.
    old = d["old"].clone().requires_grad_(True)
    beh = d["beh"].clone().requires_grad_(True)
    loss, _ = policy_loss(d["lp"], old, beh, d["adv"], d["mask"], tis)
    assert loss.item() != pytest.approx(run(d, plain)[0].item(), rel=1e-6)
    loss.backward()
    assert old.grad is None and beh.grad is None


def test_kl_estimators_expectations_on_a_categorical():
    # E_{x~q}[k1] = E_{x~q}[k3] = KL(q || p) exactly; k2 is biased; k2, k3 >= 0 pointwise.
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)
    q = logq.exp()
    kl = sum(qi * (a - b) for qi, a, b in zip(q.tolist(), logq.tolist(), logp.tolist()))
    e = {k: (q * kl_estimate(logq, logp, k)).sum().item() for k in ("k1", "k2", "k3")}
    assert e["k1"] == pytest.approx(kl, rel=1e-12)
    assert e["k3"] == pytest.approx(kl, rel=1e-12)
    assert e["k2"] != pytest.approx(kl, rel=1e-3)
    assert (kl_estimate(logq, logp, "k3") >= 0).all() and (kl_estimate(logq, logp, "k2") >= 0).all()
    assert (kl_estimate(logq, logp, "k1") < 0).any()


def test_kl_term_and_ref_metric():
    d = make_batch(7, 3, 4)
    with_ref, m1 = run(d, AlgorithmConfig())  # kl_coef 0: ref only logged
    without, m0 = policy_loss(d["lp"], d["old"], d["beh"], d["adv"], d["mask"], AlgorithmConfig())
    assert with_ref.item() == without.item() and m1["loss/kl"] == 0.0
    assert "kl/ref" in m1 and "kl/ref" not in m0
    loss, m = run(d, AlgorithmConfig(kl_coef=0.5, kl_estimator="k2"))
    assert m["loss/kl"] > 0 and loss.item() == pytest.approx(m["loss/policy"] + m["loss/kl"], rel=1e-12)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        policy_loss(d["lp"], d["old"], d["beh"], d["adv"], d["mask"], AlgorithmConfig(kl_coef=0.1))


def test_metric_keys_and_logprob_gap():
    d = make_batch(8, 3, 5)
    m = d["mask"].bool()
    want_mean = (d["lp"].detach() - d["beh"]).abs()[m].mean().item()
    want_max = (d["lp"].detach() - d["beh"]).abs()[m].max().item()
    assert logprob_gap(d["lp"], d["beh"], d["mask"]) == pytest.approx((want_mean, want_max))
    # Reported whenever behaviour logprobs are given, whatever the ratio.
    _, metrics = policy_loss(d["lp"], d["old"], d["beh"], d["adv"], d["mask"], AlgorithmConfig(ratio="old"))
    assert (metrics["logprob_gap/mean"], metrics["logprob_gap/max"]) == pytest.approx((want_mean, want_max))
    assert set(metrics) == {"loss/policy", "loss/kl", "clip/low_frac", "clip/high_frac", "kl/approx",
                            "ratio/mean", "ratio/max", "logprob_gap/mean", "logprob_gap/max"}
    _, metrics = policy_loss(d["lp"], d["old"], None, d["adv"], d["mask"], AlgorithmConfig(ratio="old"))
    assert "logprob_gap/mean" not in metrics
    assert all(isinstance(v, float) for v in metrics.values())


def test_empty_mask_and_bad_inputs():
    d = make_batch(9, 2, 3)
    zeros = torch.zeros(2, 3)
    for agg in AGGS:
        cfg = AlgorithmConfig(loss_agg=agg, loss_norm_constant=4)
        loss, metrics = policy_loss(d["lp"], None, d["beh"], d["adv"], zeros, cfg)
        loss.backward()
        assert loss.item() == 0.0 and all(v == 0.0 for v in metrics.values())
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(d["lp"], d["old"], None, d["adv"], d["mask"], AlgorithmConfig())
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(d["lp"], None, d["beh"], d["adv"], d["mask"], AlgorithmConfig(ratio="old"))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(d["lp"], None, d["beh"], d["adv"][:1], d["mask"], AlgorithmConfig())
    with pytest.raises(ValueError, match="mask"):
        policy_loss(d["lp"], None, d["beh"], d["adv"], zeros[:, :2], AlgorithmConfig())
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(d["lp"], d["mask"], "constant_norm")


# --------------------------------------------------------------------- overlong


def ref_soft_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return penalty * ((max_len - buffer) - length) / buffer
    return -penalty


@pytest.mark.parametrize("max_len,buffer,penalty", [(20, 8, 1.0), (20, 0, 0.5), (10, 9, 2.0)])
def test_soft_overlong_penalty(max_len, buffer, penalty):
    lengths = list(range(max_len + 4))
    got = soft_overlong_penalty(torch.tensor(lengths), max_len, buffer, penalty).tolist()
    want = [ref_soft_penalty(n, max_len, buffer, penalty) for n in lengths]
    assert got == pytest.approx(want, abs=1e-6)
    assert all(a >= b for a, b in itertools.pairwise(got))  # longer is never better
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(torch.tensor(lengths), max_len, max_len, penalty)


def test_overlong_mask_and_apply():
    mask = torch.ones(3, 4)
    want = [[1.0] * 4, [0.0] * 4, [1.0] * 4]
    assert overlong_mask(mask, ["stop", "length", "abort"]).tolist() == want
    assert overlong_mask(mask, torch.tensor([False, True, False])).tolist() == want
    assert overlong_mask(mask.bool(), [False, True, False]).dtype == torch.bool
    with pytest.raises(ValueError, match="one truncated flag per row"):
        overlong_mask(mask, ["stop"])

    rewards = torch.tensor([1.0, 1.0, 0.0])
    lengths = torch.tensor([10, 20, 17])
    reasons = ["stop", "length", "stop"]
    r, m = apply_overlong(AlgorithmConfig(overlong="mask"), rewards, mask, lengths, reasons, 20)
    assert r is rewards and m.tolist() == want
    r, m = apply_overlong(AlgorithmConfig(preset="dapo", overlong_buffer=8), rewards, mask, lengths, reasons, 20)
    assert m is mask and r.tolist() == pytest.approx([1.0, 0.0, -5 / 8])
    r, m = apply_overlong(AlgorithmConfig(), rewards, mask, lengths, reasons, 20)
    assert r is rewards and m is mask
