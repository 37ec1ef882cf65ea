"""forge eval's statistics (core/forgerl/runloop/eval_stats.py): pass@k with the unbiased
estimator against values worked out by hand from binomials, mean@k, the intervals over
problems, and the split by source and by reward component."""

from __future__ import annotations

import math

import pytest

from forgerl.runloop.eval_stats import interval, ks_reported, pass_at_k, summarize

# (n samples, c correct, k) -> 1 - C(n-c, k) / C(n, k), by hand.
TABLE = [
    (5, 0, 1, 0.0),
    (5, 1, 1, 0.2),  # pass@1 is the fraction correct
    (5, 5, 3, 1.0),
    (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
    (4, 1, 2, 1 - 3 / 6),  # C(3,2)=3, C(4,2)=6
    (8, 1, 4, 1 - 35 / 70),  # C(7,4)=35, C(8,4)=70
    (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
    (4, 2, 3, 1.0),  # fewer wrong samples than k: every draw of 3 holds a correct one
    (200, 10, 100, 1 - math.comb(190, 100) / math.comb(200, 100)),
]


@pytest.mark.parametrize(("n", "c", "k", "expected"), TABLE)
def test_pass_at_k_matches_the_hand_computed_table(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-12), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_the_ks_reported() -> None:
    assert ks_reported(1) == [1]
    assert ks_reported(4) == [1, 2, 4]
    assert ks_reported(10) == [1, 2, 4, 8, 10]


def rows(group: int, correct: list[int], source: str | None = None) -> list[dict]:
    return [
        {"group": group, "index": i, "correct": bool(c), "reward": float(c) + 0.5, "source": source,
         "components": {"math": float(c)} if i else {"math": float(c), "used_tool": 1.0}}
        for i, c in enumerate(correct)
    ]  # fmt: skip


def test_mean_and_pass_at_k_over_problems_with_normal_intervals() -> None:
    records = rows(0, [1, 0, 0, 0], "easy") + rows(1, [1, 1, 0, 0], "easy") + rows(2, [0, 0, 0, 0], "hard")
    out = summarize(records, 4, 0.95)
    assert out["problems"] == 3 and out["samples"] == 12
    assert out["mean@4"]["mean"] == pytest.approx(0.25)
    assert out["pass"]["pass@1"]["mean"] == pytest.approx(0.25)
    assert out["pass"]["pass@2"]["mean"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert out["pass"]["pass@4"]["mean"] == pytest.approx(2 / 3)
    # [1, 1, 0]: sd sqrt(1/3), half-width 1.959964 * sd / sqrt(3); a rate is clipped to [0, 1].
    assert out["pass"]["pass@4"]["low"] == pytest.approx(
        2 / 3 - 1.959964 * math.sqrt(1 / 3) / math.sqrt(3), abs=1e-6
    )
    assert out["pass"]["pass@4"]["high"] == 1.0
    assert out["reward"]["mean"] == pytest.approx(0.75)
    # A component a sample does not report counts 0: used_tool is 1 in one sample of four.
    assert out["components"]["used_tool"]["mean"] == pytest.approx(0.25)
    assert out["components"]["math"]["mean"] == pytest.approx(0.25)
    assert set(out["sources"]) == {"easy", "hard"}
    assert out["sources"]["easy"]["pass"]["pass@4"]["mean"] == 1.0
    assert out["sources"]["easy"]["mean@4"]["mean"] == pytest.approx(0.375)
    assert out["sources"]["hard"]["problems"] == 1 and out["sources"]["hard"]["mean@4"]["low"] is None


def test_a_problem_short_of_k_samples_counts_in_mean_but_not_in_pass_at_k() -> None:
    out = summarize(rows(0, [1, 1]) + rows(1, [0]), 2, 0.9)
    assert out["mean@2"]["mean"] == pytest.approx(0.5)
    assert out["pass"]["pass@2"]["mean"] == 1.0, "only the finished problem"
    assert "sources" not in out


def test_interval_edges() -> None:
    assert interval([], 0.95) == {"mean": None, "low": None, "high": None}
    assert interval([0.5], 0.95) == {"mean": 0.5, "low": None, "high": None}
    same = interval([0.5, 0.5], 0.95)
    assert same["low"] == same["high"] == 0.5
    wide = interval([-3.0, 3.0], 0.95, rate=False)
    assert wide["low"] < -3.0 and wide["high"] > 3.0
