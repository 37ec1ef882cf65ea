"""The scoring engine: weighted sums, failures, timeouts, concurrency.

Reward instances handed to RewardSet directly run on threads in this process; rewards
built from the registry run in worker processes, which a timeout kills and replaces
(the tests at the end, with the misbehaving rewards of tests/helpers/fault_rewards.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forgerl.configuration.config import RunConfig
from forgerl.interfaces import Reward
from forgerl.registry.plugins import build_registry
from forgerl.rewards.reward_workers import RewardRecipe
from forgerl.rewards.rewarding import NamedReward, RewardSet
from forgerl.types import Problem, RewardInput, RewardResult

from ..helpers.reward_processes import reward_workers_of
from ..helpers.timing import scaled, wait_until

FAULTS = "tests.helpers.fault_rewards"
BACKTRACKING = "^(.+)+\\x00"  # catastrophic backtracking on any text without a NUL


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
    rs = RewardSet([("hang", 1.0, Sleeps(30.0)), ("ok", 1.0, Const(1.0))], timeout=0.3, failed_reward=-0.5)
    start = time.monotonic()
    results = rs.score_sync(inputs(4))
    elapsed = time.monotonic() - start
    assert elapsed < scaled(5), f"took {elapsed:.2f}s for a 0.3s timeout"
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
    assert time.monotonic() - start < scaled(5)
    assert "hang: timed out after 0.2s" in r.error and "own: TimeoutError: judge took too long" in r.error, (
        r.error
    )


def test_many_slow_async_rewards_run_concurrently():
    rs = RewardSet([("slow", 1.0, AsyncSleeps(3)), ("slow2", 1.0, AsyncSleeps(3, 2.0))], timeout=30)
    start = time.monotonic()
    results = rs.score_sync(inputs(100))
    elapsed = time.monotonic() - start
    # Serially, 200 calls of 3 s take 600 s.
    assert elapsed < scaled(20), f"200 calls of 3s took {elapsed:.2f}s: not concurrent"
    assert [r.value for r in results] == [3.0] * 100


def test_sync_rewards_run_in_a_bounded_set_of_threads():
    class Counting(Reward):
        """Holds each call until 4 run at once (or a deadline): shows both the bound and
        that the calls really overlap, without measuring speed."""

        def __init__(self):
            self.lock = threading.Lock()
            self.running = self.most = 0
            self.four = threading.Event()

        def score(self, sample):
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
                if self.running == 4:
                    self.four.set()
            self.four.wait(scaled(5))
            with self.lock:
                self.running -= 1
            return 1.0

    reward = Counting()
    results = RewardSet([("c", 1.0, reward)], timeout=scaled(30), max_workers=4).score_sync(inputs(12))
    assert reward.most == 4, f"at most {reward.most} calls ran at once on 4 threads"
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
    with RewardSet.from_config(config, build_registry()) as rs:
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


# ------------------------------------------------------------- worker processes


def reward_set(*rewards: dict, timeout: float = 1.0, failed_reward: float = -1.0, workers: int = 2) -> RewardSet:
    """A RewardSet built like a run builds it: from config, through the registry (with the
    misbehaving test rewards registered), so the blocking rewards run in worker processes."""
    config = RunConfig.model_validate(
        {"rewards": list(rewards), "loop": {"reward_timeout": timeout, "failed_reward": failed_reward}}
    )
    return RewardSet.from_config(config, build_registry(plugins=[FAULTS]), max_workers=workers)


def score_within(rs: RewardSet, samples: list[RewardInput], seconds: float) -> list[RewardResult]:
    """score_sync, failing the test (instead of hanging it) when no answer comes in time."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(rs.score_sync(samples)), daemon=True)
    thread.start()
    wait_until(lambda: box, seconds, f"{len(samples)} samples to be scored")
    return box[0]


def pid_of(result: RewardResult) -> int:
    return int(result.components["fault_pid/pid"])


def test_blocking_rewards_run_in_reused_worker_processes():
    with reward_set({"name": "fault_pid"}) as rs:
        first = score_within(rs, inputs(6), 60)
        second = score_within(rs, inputs(6), 60)
        pids = {pid_of(r) for r in first + second}
        assert os.getpid() not in pids
        assert pids <= set(rs.pool.pids()) and len(rs.pool.pids()) == 2, (pids, rs.pool.pids())
        assert rs.pool.starts == 2, f"{rs.pool.starts} workers started for a pool of 2: not reused"
        assert all(r.value == 1.0 and not r.failed for r in first + second)
    assert reward_workers_of(os.getpid()) == []


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"name": "fault_spin"}, "timed out after 1s"),  # loops in Python, ignores SIGTERM
        ({"name": "format", "options": {"pattern": BACKTRACKING}}, "timed out after 1s"),  # in C, GIL held
        ({"name": "fault_raise"}, "RuntimeError: this reward always raises"),
        ({"name": "fault_exit"}, "its reward worker died (exit status 3)"),
        ({"name": "fault_segv"}, "its reward worker died (killed by SIGSEGV)"),
        ({"name": "fault_nan"}, "returned nan, expected a finite number"),
    ],
    ids=["python-loop", "regex-holding-the-gil", "raises", "os-exit", "segfault", "nan"],
)
def test_a_misbehaving_reward_is_scored_failed_and_the_rest_is_unaffected(bad, error):
    rs = reward_set(bad, {"name": "fault_pid"}, timeout=1.0, failed_reward=-1.0)
    name = bad["name"]
    try:
        # 3 samples on 2 workers: at most 2 rounds of 1 s timeouts, plus restarts.
        results = score_within(rs, inputs(3, "a" * 40), 60)
        for r in results:
            assert r.failed and r.components[name] == -1.0, r
            assert r.components["fault_pid"] == 1.0 and r.value == pytest.approx(0.0), r
            assert r.error == f"{name}: {error}" + (" (its worker was killed and replaced)" if "timed" in error
                                                    else " and was replaced" if "died" in error else ""), r.error
        # The pool never shrinks: the killed or dead workers were replaced, and score again.
        wait_until(lambda: len(rs.pool.pids()) == 2, 60, "the pool to be back to 2 live workers")
        again = score_within(rs, inputs(2, "a" * 40), 60)
        assert all(r.failed and r.components["fault_pid"] == 1.0 for r in again), again
    finally:
        rs.close()
    assert reward_workers_of(os.getpid()) == [], "a reward worker outlived close()"


@pytest.mark.parametrize("how", ["spin", "exit"])
def test_one_bad_sample_does_not_affect_the_other_samples(how):
    with reward_set({"name": "fault_trigger", "options": {"how": how}}, timeout=1.0, failed_reward=0.0) as rs:
        texts = ["fine", "HANG here", "fine too", "also fine"]
        samples = [RewardInput(Problem(id=f"p{i}", prompt="q", answer="42"), t) for i, t in enumerate(texts)]
        results = score_within(rs, samples, 60)
        assert [r.failed for r in results] == [False, True, False, False], results
        assert [r.value for r in results] == [1.0, 0.0, 1.0, 1.0], results
        expected = "timed out after 1s" if how == "spin" else "its reward worker died (exit status 3)"
        assert results[1].error.startswith(f"fault_trigger: {expected}"), results[1].error
    assert reward_workers_of(os.getpid()) == []


def test_a_killed_worker_is_replaced_and_the_replacement_serves():
    with reward_set({"name": "fault_trigger"}, {"name": "fault_pid"}, timeout=1.0, workers=1) as rs:
        (before,) = score_within(rs, inputs(1), 60)
        (hung,) = score_within(rs, [RewardInput(Problem(id="p", prompt="q"), "HANG")], 60)
        (after,) = score_within(rs, inputs(1), 60)
        assert not before.failed and hung.failed and not after.failed, (before, hung, after)
        assert pid_of(before) != pid_of(after), "the worker that hung was not replaced"
        assert pid_of(before) not in reward_workers_of(os.getpid()), "the worker that hung is still alive"
        assert rs.pool.timeouts == 1 and len(rs.pool.replacement_seconds) == 1, rs.pool.replacement_seconds


def test_close_stops_a_busy_worker_and_later_scoring_fails_without_raising():
    rs = reward_set({"name": "fault_spin"}, timeout=600)
    box: list = []
    thread = threading.Thread(target=lambda: box.append(rs.score_sync(inputs(1))), daemon=True)
    thread.start()
    wait_until(lambda: any(s.busy for s in rs.pool._slots), 60, "a worker to take the sample")
    rs.close()
    wait_until(lambda: box, 30, "the sample being scored to be answered after close()")
    assert box[0][0].failed and "closed" in box[0][0].error, box[0]
    assert reward_workers_of(os.getpid()) == []
    (late,) = rs.score_sync(inputs(1))
    assert late.failed and late.error == "fault_spin: the reward workers were closed", late


def test_workers_that_cannot_start_fail_their_samples_fast():
    # A recipe no worker can build (its backend exists only in this process).
    rs = RewardSet(
        [NamedReward("ghost", 1.0, Const(1.0), RewardRecipe("no_such_reward")), ("ok", 1.0, Const(1.0))],
        timeout=1.0,
        max_workers=1,
    )
    with rs:
        results = score_within(rs, inputs(5), 60)
        assert all(r.failed and r.components["ok"] == 1.0 for r in results), results
        assert all("no_such_reward" in r.error for r in results), [r.error for r in results]
        assert rs.pool.broken and rs.pool.starts <= 3, (rs.pool.broken, rs.pool.starts)
    assert reward_workers_of(os.getpid()) == []


def test_rewards_of_an_embedded_plugin_object_run_in_this_process():
    from tests.helpers import fault_rewards

    config = RunConfig.model_validate({"rewards": [{"name": "fault_pid"}]})
    with RewardSet.from_config(config, build_registry(plugins=[fault_rewards])) as rs:
        assert rs.pool is None  # a worker could not import an object that lives only here
        (r,) = rs.score_sync(inputs(1))
        assert pid_of(r) == os.getpid(), r


PARENT = """
import sys, time
from forgerl.configuration.config import RunConfig
from forgerl.registry.plugins import build_registry
from forgerl.rewards.rewarding import RewardSet
from forgerl.types import Problem, RewardInput

config = RunConfig.model_validate({"rewards": [{"name": "fault_spin"}], "loop": {"reward_timeout": 600}})
rs = RewardSet.from_config(config, build_registry(plugins=["tests.helpers.fault_rewards"]), max_workers=2)
print("scoring", flush=True)
rs.score_sync([RewardInput(Problem(id="p", prompt="q"), "x")] * 2)
"""


def test_workers_die_with_a_killed_parent():
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout.readline().strip() == "scoring"
        wait_until(lambda: len(reward_workers_of(parent.pid)) == 2, 60, "two workers spinning on a reward")
        orphans = reward_workers_of(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(scaled(30))
        wait_until(lambda: not reward_workers_of(parent.pid), 30, f"workers {orphans} to die with their parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
