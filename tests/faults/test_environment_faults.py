"""An environment that hangs, raises or returns garbage fails its own trajectory (scored
``loop.failed_reward``, counted, recorded with the reason), never the batch or the run;
the other trajectories of the batch finish normally, and a hung one does not hold them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from forgerl.environment import Environment, Step
from forgerl.interfaces import Generator
from forgerl.rollouts.env_rollouts import FAILURES_FILE, EnvironmentRollouts
from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
from forgerl.types import Completion, Problem, RewardResult, SamplingParams
from tests.helpers.timing import scaled

pytest.importorskip("transformers")

FAILED_REWARD = -0.5
#: Released at teardown, so no hung thread outlives its test.
RELEASE = threading.Event()


@pytest.fixture(autouse=True)
def _release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Fixed(Generator):
    def __init__(self, tokenizer):
        self.ids = [*list(tokenizer("four", add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]

    async def generate(self, requests):
        return [[Completion(list(self.ids), [-0.5] * len(self.ids), "stop", 0, "four")] for _ in requests]

    def update_weights(self, version):
        raise AssertionError("not used")

    @property
    def policy_version(self):
        return 0


class Good(Environment):
    scores = True

    def reset(self, problem):
        if problem.id.startswith("bad"):
            return self.bad_reset()
        return [{"role": "user", "content": "What is 2 + 2?"}]

    def bad_reset(self):
        return [{"role": "user", "content": "x"}]

    def step(self, text):
        return Step.finish(1.0, correct=1.0)


class HangsInStep(Good):
    def step(self, text):
        RELEASE.wait()
        return Step.finish(1.0)


class HangsInReset(Good):
    def bad_reset(self):
        RELEASE.wait()
        return []


class RaisesInStep(Good):
    def step(self, text):
        raise RuntimeError("the environment's own bug")


class RaisesInReset(Good):
    def bad_reset(self):
        raise KeyError("no such problem")


class NotAListFromReset(Good):
    def bad_reset(self):
        return "What is 2 + 2?"


class BadRoleFromReset(Good):
    def bad_reset(self):
        return [{"role": "wizard", "content": "x"}]


class NotAStep(Good):
    def step(self, text):
        return {"done": True, "reward": 1.0}


class NanReward(Good):
    def step(self, text):
        return Step.finish(float("nan"))


class NeitherObservationNorDone(Good):
    def step(self, text):
        return Step()


class HugeObservation(Good):
    def step(self, text):
        return Step.observe({"role": "user", "content": "x" * 10_000_000})


def make(env_class, tokenizer, run_dir: Path, timeout: float = 0.5) -> EnvironmentRollouts:
    # Only the problems named "bad..." reach the faulty code; the good ones share the batch.
    class Mixed(env_class):  # type: ignore[misc, valid-type]
        def __init__(self):
            self.faulty = True

        def step(self, text):
            return env_class.step(self, text) if self.problem_id.startswith("bad") else Good.step(self, text)

        def reset(self, problem):
            self.problem_id = problem.id
            return env_class.reset(self, problem)

    limits = Limits(max_turns=2, max_total_tokens=200, max_turn_tokens=16, turn_timeout=timeout, concurrency=8)
    runner = TrajectoryRunner(Mixed, Mixed, tokenizer, limits, SamplingParams())
    return EnvironmentRollouts(runner, failed_reward=FAILED_REWARD, run_dir=run_dir)


async def never_called(samples):
    raise AssertionError(f"these environments score themselves; the Reward plugins got {samples}")


CASES = {
    HangsInStep: ("timeout", "step did not return within"),
    HangsInReset: ("timeout", "reset did not return within"),
    RaisesInStep: ("error", "RuntimeError: the environment's own bug"),
    RaisesInReset: ("error", "KeyError"),
    NotAListFromReset: ("garbage", "reset returned str, not a list of messages"),
    BadRoleFromReset: ("garbage", "needs a role"),
    NotAStep: ("garbage", "step returned dict, not a Step"),
    NanReward: ("garbage", "not a finite number"),
    NeitherObservationNorDone: ("garbage", "neither observation messages nor done"),
    HugeObservation: ("garbage", "characters (at most"),
}


@pytest.mark.parametrize("env_class", list(CASES), ids=lambda c: c.__name__)
def test_a_faulty_environment_fails_only_its_trajectory(env_class, tokenizer, tmp_path):
    kind, reason = CASES[env_class]
    rollouts = make(env_class, tokenizer, tmp_path)
    jobs = [(Problem(pid, "q", "4"), f"r-{pid}", 1) for pid in ("good-0", "bad-0", "good-1", "bad-1")]
    started = time.perf_counter()
    scored, metrics = asyncio.run(rollouts.scored(Fixed(tokenizer), jobs, never_called))
    took = time.perf_counter() - started
    good = [s for (p, *_), s in zip(jobs, scored) if p.id.startswith("good")]
    bad = [s for (p, *_), s in zip(jobs, scored) if p.id.startswith("bad")]
    assert all(s.trajectory.failure is None and s.result == RewardResult(1.0, {"correct": 1.0}) for s in good), good
    for s in bad:
        assert s.trajectory.failure_kind == kind and reason in (s.trajectory.failure or ""), s.trajectory.failure
        assert s.result.failed and s.result.value == FAILED_REWARD and reason in (s.result.error or "")
        assert set(s.trajectory.completion.mask or []) <= {0}, "an environment's failure is not trained on"
    assert metrics["env/failed"] == 2 and metrics[f"env/failed_{kind}"] == 2, metrics
    # Both hung trajectories wait out one deadline together (concurrently), not one each.
    assert took < scaled(5.0), f"{took:.1f} s for a batch with a deadline of 0.5 s"
    lines = [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()]
    assert sorted(line["problem"] for line in lines) == ["bad-0", "bad-1"]
    assert all(line["kind"] == kind and reason in line["reason"] for line in lines), lines


def test_a_hung_environment_does_not_hold_the_others(tokenizer, tmp_path):
    """With concurrency 2 and a hung environment holding one slot, the other trajectories
    still run through the free slot. Its deadline is far off (it is released by the test
    once the others are done): with a 3 s one, five good trajectories had to finish within
    3 s on a loaded machine, which is speed, not what the test is about."""
    rollouts = make(HangsInStep, tokenizer, tmp_path, timeout=scaled(60.0))
    rollouts.runner.limits = Limits(max_turns=2, max_total_tokens=200, max_turn_tokens=16,
                                    turn_timeout=scaled(60.0), concurrency=2)
    done = []

    async def go():
        gen = Fixed(tokenizer)
        from forgerl.rollouts.trajectory import RequestBatcher

        batcher = RequestBatcher(gen)
        hung = asyncio.ensure_future(rollouts.runner.run(batcher, Problem("bad", "q"), "rb", 1))
        for i in range(5):
            done.append(await rollouts.runner.run(batcher, Problem(f"good-{i}", "q"), f"r{i}", 1))
        # Every good trajectory finished while the hung one was still waiting.
        assert not hung.done(), "the hung trajectory ended before the others ran"
        RELEASE.set()
        return await hung

    hung = asyncio.run(go())
    assert [t.reward for t in done] == [1.0] * 5
    assert hung.failure is None or hung.failure_kind == "timeout"


def test_a_failing_generator_fails_the_batch_not_just_a_trajectory(tokenizer, tmp_path):
    """The environment's failures are contained; the generator's are not theirs to hide."""

    class Broken(Fixed):
        async def generate(self, requests):
            raise RuntimeError("engine died")

    rollouts = make(Good, tokenizer, tmp_path)
    jobs = [(Problem("good-0", "q"), "r0", 1)]
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(rollouts.scored(Broken(tokenizer), jobs, never_called))
    assert not (tmp_path / FAILURES_FILE).exists()


def test_abandoned_calls_are_counted_until_they_return():
    from forgerl.rollouts.bounded import CallTimeout, abandoned_threads, call_bounded

    before = abandoned_threads()
    returned = threading.Event()

    def hang() -> None:
        RELEASE.wait()
        returned.set()

    async def go():
        with pytest.raises(CallTimeout, match="hang did not return within 0.05 s"):
            await call_bounded(hang, timeout=0.05, what="hang")

    asyncio.run(go())
    assert abandoned_threads() == before + 1
    RELEASE.set()
    assert returned.wait(scaled(10))
    deadline = time.monotonic() + scaled(10)
    while abandoned_threads() != before and time.monotonic() < deadline:
        returned.wait(0.01)  # the thread decrements right after setting the event
    assert abandoned_threads() == before
