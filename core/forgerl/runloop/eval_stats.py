"""The statistics ``forge eval`` reports (docs/eval.md): mean@k, pass@k with the unbiased
estimator, and normal-approximation confidence intervals over problems.

With ``n`` samples of a problem of which ``c`` are correct, pass@k (k <= n) is estimated
without bias as ``1 - C(n - c, k) / C(n, k)`` (the chance that k samples drawn without
replacement from the n include a correct one), then averaged over problems. mean@k is a
problem's fraction of correct samples, averaged over problems. Every interval is the mean
of the per-problem values plus or minus ``z * sd / sqrt(problems)`` (the sample standard
deviation over problems; z of the chosen level), clipped to [0, 1] for rates: it treats
problems as the random draw, which is what a held-out set is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from statistics import NormalDist
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples with ``c`` correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): the ratio of binomials without big integers.
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_reported(k: int) -> list[int]:
    """The k of pass@k reported for ``k`` samples per problem: 1, the powers of 2 below
    ``k``, and ``k``."""
    out = [1]
    while out[-1] * 2 < k:
        out.append(out[-1] * 2)
    return sorted({*out, k})


def interval(values: Sequence[float], confidence: float, *, rate: bool = True) -> dict[str, float | None]:
    """The mean of ``values`` with its normal-approximation interval over them."""
    n = len(values)
    if n == 0:
        return {"mean": None, "low": None, "high": None}
    m = sum(values) / n
    if n < 2:
        return {"mean": m, "low": None, "high": None}
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * sd / math.sqrt(n)
    low, high = m - half, m + half
    if rate:
        low, high = max(0.0, low), min(1.0, high)
    return {"mean": m, "low": low, "high": high}


def summarize(records: Iterable[Mapping[str, Any]], k: int, confidence: float) -> dict[str, Any]:
    """The summary of per-sample records (``group``, ``correct``, ``reward``,
    ``components``, ``source``): overall and per source."""
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(int(r["group"]), []).append(r)
    out = _block(list(groups.values()), k, confidence)
    sources = sorted({str(s[0].get("source")) for s in groups.values() if s[0].get("source") is not None})
    if sources:
        out["sources"] = {
            name: _block([s for s in groups.values() if str(s[0].get("source")) == name], k, confidence)
            for name in sources
        }
    return out


def _block(groups: list[list[Mapping[str, Any]]], k: int, confidence: float) -> dict[str, Any]:
    """The statistics of some problems, each with its samples."""
    per_problem_correct = [[bool(r.get("correct")) for r in samples] for samples in groups]
    complete = [c for c in per_problem_correct if len(c) >= k]
    out: dict[str, Any] = {
        "problems": len(groups),
        "samples": sum(len(c) for c in per_problem_correct),
        "k": k,
        "confidence": confidence,
        f"mean@{k}": interval([sum(c) / len(c) for c in per_problem_correct if c], confidence),
        "pass": {
            f"pass@{j}": interval([pass_at_k(len(c), sum(c), j) for c in complete], confidence)
            for j in ks_reported(k)
        },
        "reward": interval(
            [_mean(float(r.get("reward") or 0.0) for r in samples) for samples in groups],
            confidence,
            rate=False,
        ),
    }
    names = dict.fromkeys(name for samples in groups for r in samples for name in (r.get("components") or {}))
    # A component a sample does not report counts 0, as in the run's own evaluation.
    out["components"] = {name: interval(_component(groups, name), confidence, rate=False) for name in names}
    return out


def _component(groups: list[list[Mapping[str, Any]]], name: str) -> list[float]:
    """Each problem's mean of component ``name`` over its samples."""
    return [_mean(float((r.get("components") or {}).get(name, 0.0)) for r in samples) for samples in groups]


def _mean(xs: Iterable[float]) -> float:
    values = list(xs)
    return sum(values) / len(values) if values else 0.0
