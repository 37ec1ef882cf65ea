"""The scoring engine: weighted sums, failures, timeouts, concurrency."""

from __future__ import annotations

import asyncio
import time

import pytest

from forgerl.config import RunConfig
from forgerl.interfaces import Reward
from forgerl.plugins import build_registry
from forgerl.rewarding import RewardSet
from forgerl.types import Problem, RewardInput, RewardResult


def inputs(n=1, text="<answer>42</answer>"):
    return [RewardInput(Problem(id=f"p{i}", prompt="q", answer="42"), text) for i in range(n)]


class Const(Reward):
    def __init__(self, value):
        self.value = value

    def score(self, sample):
        return self.value


class Raises(Reward):
    def score(self, sample):
        raise ValueError("bad sample")


class Sleeps(Reward):
    def __init__(self, seconds):
        self.seconds = seconds

    def score(self, sample):
        time.sleep(self.seconds)
        return 1.0


class AsyncSleeps(Reward):
    def __init__(self, seconds, value=1.0):
        self.seconds, self.value = seconds, value

    async def ascore(self, sample):
        await asyncio.sleep(self.seconds)
        return self.value


def test_weighted_sum_and_components():
    rs = RewardSet(
        [
            ("a", 1.0, Const(RewardResult(1.0, {"correct": 1.0}))),
            ("b", 0.2, Const(0.5)),
            ("c", -2.0, Const(True)),
        ]
    )
    (r,) = rs.score_sync(inputs())
    assert r.value == pytest.approx(1.0 + 0.2 * 0.5 - 2.0), r
    assert dict(r.components) == {"a": 1.0, "a/correct": 1.0, "b": 0.5, "c": 1.0}
    assert not r.failed and r.error is None


def test_same_reward_twice_gets_distinct_component_names():
    rs = RewardSet([("format", 1.0, Const(1.0)), ("format", 1.0, Const(0.0))])
    assert rs.names == ["format", "format_2"]
    assert dict(rs.score_sync(inputs())[0].components) == {"format": 1.0, "format_2": 0.0}


def test_a_raising_reward_scores_failed_reward_and_the_rest_still_count():
    rs = RewardSet([("ok", 1.0, Const(1.0)), ("bad", 0.5, Raises())], failed_reward=-1.0)
    results = rs.score_sync(inputs(3))
    for r in results:
        assert r.failed
        assert r.value == pytest.approx(1.0 + 0.5 * -1.0), r
        assert r.components["bad"] == -1.0 and r.components["ok"] == 1.0
        assert "bad: ValueError: bad sample" in r.error, r.error


@pytest.mark.parametrize("returned", [None, "1.0", float("nan"), float("inf")])
def test_a_reward_returning_garbage_is_failed(returned):
    (r,) = RewardSet([("g", 1.0, Const(returned))], failed_reward=0.0).score_sync(inputs())
    assert r.failed and r.value == 0.0, r
    assert r.error.startswith("g: returned"), r.error


def test_a_reward_reporting_its_own_failure_is_failed():
    (r,) = RewardSet([("x", 1.0, Const(RewardResult(0.7, failed=True, error="judge down")))]).score_sync(
        inputs()
    )
    assert r.failed and r.value == 0.0 and r.error == "x: judge down", r


def test_a_hanging_sync_reward_times_out_within_the_timeout():
    rs = RewardSet([("hang", 1.0, Sleeps(3.0)), ("ok", 1.0, Const(1.0))], timeout=0.3, failed_reward=-0.5)
    start = time.monotonic()
    results = rs.score_sync(inputs(4))
    elapsed = time.monotonic() - start
    assert elapsed < 1.5, f"took {elapsed:.2f}s for a 0.3s timeout"
    for r in results:
        assert r.failed and r.value == pytest.approx(-0.5 + 1.0), r
        assert "hang: timed out after 0.3s" in r.error, r.error
    assert rs.abandoned_threads == 4


def test_a_hanging_async_reward_times_out_and_its_own_timeout_error_is_not_confused():
    class OwnTimeout(Reward):
        async def ascore(self, sample):
            raise TimeoutError("judge took too long")

    rs = RewardSet([("hang", 1.0, AsyncSleeps(30)), ("own", 1.0, OwnTimeout())], timeout=0.2)
    start = time.monotonic()
    (r,) = rs.score_sync(inputs())
    assert time.monotonic() - start < 1.5
    assert "hang: timed out after 0.2s" in r.error and "own: TimeoutError: judge took too long" in r.error, (
        r.error
    )


def test_many_slow_async_rewards_run_concurrently():
    rs = RewardSet([("slow", 1.0, AsyncSleeps(0.3)), ("slow2", 1.0, AsyncSleeps(0.3, 2.0))], timeout=5)
    start = time.monotonic()
    results = rs.score_sync(inputs(100))
    elapsed = time.monotonic() - start
    assert elapsed < 1.5, f"200 calls of 0.3s took {elapsed:.2f}s: not concurrent"
    assert [r.value for r in results] == [3.0] * 100


def test_sync_rewards_run_in_a_bounded_set_of_threads():
    rs = RewardSet([("slow", 1.0, Sleeps(0.2))], timeout=5, max_workers=4)
    start = time.monotonic()
    results = rs.score_sync(inputs(8))
    elapsed = time.monotonic() - start
    # 8 calls of 0.2s on 4 threads: two rounds (0.4s); serial would be 1.6s, unbounded 0.2s.
    assert 0.38 < elapsed < 1.2, f"8 x 0.2s on 4 threads took {elapsed:.2f}s"
    assert all(r.value == 1.0 and not r.failed for r in results)


def test_score_works_from_a_running_loop_and_repeatedly():
    rs = RewardSet([("c", 1.0, Const(0.25))], max_workers=2)

    async def twice():
        first = await rs.score(inputs(3))
        second = await rs.score(inputs(2))
        return first + second

    assert [r.value for r in asyncio.run(twice())] == [0.25] * 5
    assert [r.value for r in rs.score_sync(inputs(2))] == [0.25] * 2  # a second event loop


def test_from_config_builds_the_configured_rewards():
    config = RunConfig.model_validate(
        {
            "rewards": [
                {"name": "math_answer", "weight": 1.0, "options": {"fallback_credit": 0.5}},
                {"name": "format", "weight": 0.2},
            ],
            "loop": {"reward_timeout": 7, "failed_reward": -1},
        }
    )
    rs = RewardSet.from_config(config, build_registry())
    assert rs.names == ["math_answer", "format"] and rs.timeout == 7 and rs.failed_reward == -1
    tagged, untagged, wrong = rs.score_sync(
        inputs(1, "<answer>42</answer>") + inputs(1, "17 + 25 = 42") + inputs(1, "<answer>41</answer>")
    )
    assert tagged.value == pytest.approx(1.2), tagged
    assert tagged.components["math_answer/tagged"] == 1.0
    assert untagged.value == pytest.approx(0.5), untagged
    assert untagged.components["math_answer/correct"] == 1.0
    assert wrong.value == pytest.approx(0.2), wrong


def test_from_config_reports_bad_options_as_a_config_error():
    from forgerl.errors import ConfigError

    config = RunConfig.model_validate({"rewards": [{"name": "format", "options": {"pattern": "("}}]})
    with pytest.raises(ConfigError, match=r"rewards\.0\.options\.pattern"):
        RewardSet.from_config(config, build_registry())
