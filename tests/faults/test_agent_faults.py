"""A faulty agent fails its own trajectory, never the batch or the run: one that hangs
(its process killed, its thread abandoned, its coroutine cancelled at the deadline), one
that crashes or exits non-zero, one that returns or prints garbage, one that calls with a
wrong key or through another episode's URL, one that never calls. Each fault shares a
batch with good episodes, which finish normally and are not held up."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from forgerl.rollouts.agent_runner import AgentRunner
from forgerl.rollouts.env_rollouts import FAILURES_FILE, EnvironmentRollouts
from forgerl.rollouts.trajectory import Limits
from forgerl.types import Problem, RewardResult, SamplingParams
from forgerl_plugins.environments.agent import AgentProgram
from tests.helpers import agents
from tests.helpers.agents import RELEASE, SEEN, Scripted
from tests.helpers.timing import scaled, wait_until

pytest.importorskip("transformers")
pytest.importorskip("openai")

FAILED_REWARD = -0.5
PROGRAM = [sys.executable, str(Path(__file__).resolve().parents[1] / "helpers" / "openai_agent.py")]


@pytest.fixture(autouse=True)
def _release_hung_agents():
    RELEASE.clear()
    agents.STOLEN.clear()
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Mixed(AgentProgram):
    """Problems named "bad..." get the faulty agent; the others a good one."""

    faulty: AgentProgram

    def __init__(self, options):
        super().__init__(options)

    async def run_episode(self, episode):
        if episode.problem.id.startswith("bad"):
            return await self.faulty.run_episode(episode)
        return await super().run_episode(episode)


def rollouts_for(tokenizer, run_dir: Path, faulty: AgentProgram.Options, *, concurrency: int = 8):
    """Episodes of problems named "bad..." run the faulty agent, the others a good one;
    all under the faulty options' deadline (the run's)."""
    good = AgentProgram.Options(entry="tests.helpers.agents:chat_twice", timeout=faulty.timeout)

    def make() -> Mixed:
        env = Mixed(good)
        env.faulty = AgentProgram(faulty)
        return env

    limits = Limits(max_turns=4, max_total_tokens=2000, max_turn_tokens=64, turn_timeout=10.0, concurrency=concurrency)
    runner = AgentRunner(make, tokenizer, limits, SamplingParams(max_tokens=64), faulty, model="tiny", context_length=1024)
    return EnvironmentRollouts(runner, failed_reward=FAILED_REWARD, run_dir=run_dir)


async def never_called(samples):
    raise AssertionError(f"these agents give their own rewards; the Reward plugins got {samples}")


def entry(name: str, timeout: float) -> AgentProgram.Options:
    return AgentProgram.Options(entry=f"tests.helpers.agents:{name}", timeout=timeout)


def command(mode: str, timeout: float, **env: str) -> AgentProgram.Options:
    return AgentProgram.Options(command=[*PROGRAM, mode], timeout=timeout, env=env)


CASES = {
    "hangs (a thread)": (lambda t: entry("hangs", t), "timeout", "did not end within"),
    "hangs (a coroutine)": (lambda t: entry("hangs_async", t), "timeout", "did not end within"),
    "crashes": (lambda t: entry("crashes", t), "error", "KeyError: \"the agent's own bug\""),
    "returns garbage": (lambda t: entry("returns_garbage", t), "garbage", "not a reward"),
    "returns a NaN reward": (lambda t: entry("returns_nan", t), "garbage", "not a finite number"),
    "uses a wrong key": (lambda t: entry("wrong_key", t), "error", "AuthenticationError"),
    "never calls": (lambda t: entry("never_calls", t), "error", "without a call the endpoint answered"),
    "command exits non-zero": (lambda t: command("crash", t), "error", "exited with status 3; its stderr ends: "
                               "agent: the tool server is down"),
    "command prints garbage": (lambda t: command("garbage", t), "garbage", "'solved it, I think'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_faulty_agent_fails_only_its_trajectory(case, tokenizer, tmp_path):
    make_options, kind, reason = CASES[case]
    # Long enough for the good episodes on a loaded machine; the hung ones wait it out.
    deadline = scaled(3.0) if kind == "timeout" else scaled(30.0)
    rollouts = rollouts_for(tokenizer, tmp_path, make_options(deadline))
    SEEN.clear()
    jobs = [(Problem(pid, "q", "4"), f"r-{pid}", 1) for pid in ("good-0", "bad-0", "good-1", "bad-1")]
    gen = Scripted(tokenizer, ["It is 4.", "Yes."])
    started = time.perf_counter()
    try:
        scored, metrics = asyncio.run(rollouts.scored(gen, jobs, never_called))
    finally:
        rollouts.close()
    took = time.perf_counter() - started
    good = [s for (p, *_), s in zip(jobs, scored) if p.id.startswith("good")]
    bad = [s for (p, *_), s in zip(jobs, scored) if p.id.startswith("bad")]
    assert all(s.trajectory.failure is None and s.result == RewardResult(0.5, {"correct": 1.0}) for s in good), good
    for s in bad:
        assert s.trajectory.failure_kind == kind and reason in (s.trajectory.failure or ""), s.trajectory.failure
        assert s.result.failed and s.result.value == FAILED_REWARD
        assert set(s.trajectory.completion.mask or []) <= {0}, "an agent's failure is not trained on"
    assert metrics["env/failed"] == 2 and metrics[f"env/failed_{kind}"] == 2, metrics
    if kind == "timeout":
        # Both hung episodes wait out one deadline together, not one each.
        assert took < 2 * deadline, f"{took:.1f} s for a batch with a deadline of {deadline:g} s"
    if case == "hangs (a coroutine)":
        # Cancelled on its own event loop, not just left behind.
        wait_until(lambda: all(SEEN.get(p, {}).get("cancelled") for p in ("bad-0", "bad-1")), scaled(10),
                   "the hung coroutines to be cancelled")
    lines = [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()]
    assert sorted(line["problem"] for line in lines) == ["bad-0", "bad-1"]
    assert all(line["kind"] == kind for line in lines), lines


def test_a_hung_command_agent_is_killed_at_the_deadline(tokenizer, tmp_path):
    pids = tmp_path / "pids"
    rollouts = rollouts_for(tokenizer, tmp_path, command("hang", scaled(5.0), AGENT_PIDS=str(pids)))
    jobs = [(Problem(pid, "q", "4"), f"r-{pid}", 1) for pid in ("good-0", "bad-0")]
    try:
        scored, _ = asyncio.run(rollouts.scored(Scripted(tokenizer, ["It is 4.", "Yes."]), jobs, never_called))
    finally:
        rollouts.close()
    assert scored[1].trajectory.failure_kind == "timeout" and scored[0].trajectory.failure is None
    [pid] = [int(p) for p in pids.read_text().split()]

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, scaled(10), "the hung agent's process to be killed")


def test_a_call_through_a_finished_episodes_url_is_refused(tokenizer, tmp_path):
    """An agent that keeps an earlier episode's base URL gets 410 there: its calls never
    land in another episode's trajectory; it fails its own."""
    rollouts = rollouts_for(tokenizer, tmp_path, entry("steals_urls", scaled(30.0)), concurrency=1)
    jobs = [(Problem(pid, "q", "4"), f"r-{pid}", 1) for pid in ("bad-0", "good-0", "bad-1")]
    gen = Scripted(tokenizer, ["It is 4.", "Yes."])
    try:
        scored, _ = asyncio.run(rollouts.scored(gen, jobs, never_called))
    finally:
        rollouts.close()
    first, good, thief = scored
    assert first.trajectory.failure is None and first.trajectory.turns == 1, "the first episode kept its URL and used it"
    assert good.trajectory.failure is None and good.trajectory.turns == 2
    assert thief.trajectory.failure_kind == "error" and "episode is over" in (thief.trajectory.failure or "")
    assert len(gen.requests) == 3, "the stolen call never reached the generator"


def test_the_endpoint_answers_while_an_agent_hangs_in_a_call(tokenizer, tmp_path):
    """A hung agent holds nothing of the endpoint's: other episodes' calls are answered
    while it waits (concurrency 2: the hung one holds one slot until its deadline)."""
    rollouts = rollouts_for(tokenizer, tmp_path, entry("hangs", scaled(30.0)), concurrency=2)
    jobs = [(Problem("bad-0", "q", "4"), "r-bad", 1)] + [(Problem(f"good-{i}", "q", "4"), f"r{i}", 1) for i in range(4)]
    gen = Scripted(tokenizer, ["It is 4.", "Yes."])

    async def go():
        task = asyncio.ensure_future(rollouts.scored(gen, jobs, never_called))
        await asyncio.to_thread(wait_until, lambda: len(gen.requests) >= 9, scaled(20), "the good episodes' calls")
        assert not task.done(), "the batch ended before the hung agent's deadline"
        RELEASE.set()
        return await task

    try:
        scored, _ = asyncio.run(go())
    finally:
        rollouts.close()
    assert [s.trajectory.turns for s in scored[1:]] == [2, 2, 2, 2]
    assert scored[0].trajectory.failure is None and scored[0].result.value == 1.0, "released before its deadline"
