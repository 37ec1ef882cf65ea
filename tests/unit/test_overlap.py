"""``loop.overlap: continuous``: weight updates are not held back, the generators are kept
full up to ``loop.max_in_flight``, batches are formed in completion order, samples that
finish too late are dropped or masked, a checkpoint hands back what it could not keep, and
``time/generator_idle_frac`` shows the generator's idle share of each step.

The loop runs for real around fakes (as in test_loop_fixed_weights). The fake generator
here takes one group per request (as the continuous producer sends them), can hold a
request until it serves some version or until the test releases it, and labels tokens as
the vllm generator's ``keep`` does: the first two by the version served when the request
arrived, the rest by the version served when it finished. Every wait is on a condition,
bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from forgerl.configuration.config import RunConfig
from forgerl.interfaces import Generator, RunContext
from forgerl.registry.plugins import build_registry
from forgerl.rollouts.generator_idle import IdleClock, WatchedGenerator
from forgerl.rollouts.overlap import ContinuousBuffer, ContinuousProducer, default_in_flight
from forgerl.rollouts.problem_source import REQUEUED, ProblemSource
from forgerl.rollouts.rollout import RolloutBatch, Tokenizing
from forgerl.runloop.loop import Loop
from forgerl.runloop.spmd import TrainerDriver
from forgerl.types import Completion, SamplingParams
from tests.helpers.timing import scaled, wait_until

from .test_loop_fixed_weights import (
    GROUP,
    PROMPTS,
    FakeGenerator,
    FakeRewards,
    FakeSender,
    FakeTask,
    FakeTokenizer,
)

P = PROMPTS  # groups per batch


class GatedGenerator(Generator):
    """Requests (one per group) that finish when told: ``hold[request_id]``: the version the
    generator must serve first; ``after[request_id]``: a request that must finish first;
    ``arrival[request_id]``: a request that must have arrived (so that its first tokens are
    sampled at the version served then); ``held_by_test``: which requests wait for
    :meth:`release`; ``loads_after[version]``: a request that must finish before that
    version is loaded (so that all its tokens are sampled by the version before)."""

    def __init__(self, hold: dict[str, int] | None = None, after: dict[str, str] | None = None,
                 held_by_test: Callable[[str], bool] | None = None,
                 arrival: dict[str, str] | None = None,
                 loads_after: dict[int, str] | None = None):  # fmt: skip
        self.hold = dict(hold or {})
        self.after = dict(after or {})
        self.arrival = dict(arrival or {})
        self.loads_after = dict(loads_after or {})
        self.arrived: set[str] = set()
        self.finished: set[str] = set()
        self.held_by_test = held_by_test or (lambda rid: False)
        self.cond = threading.Condition()
        self._version = 0
        self.active: list[str] = []  # requests in flight
        self.max_active = 0
        self.released: set[str] = set()
        self.updates: list[int] = []
        self.in_flight_at_update: dict[int, list[str]] = {}
        self.closing = False

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: ready() or self.closing, scaled(30))
        assert ok, f"gave up waiting for {what}"

    async def generate(self, requests):
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, r):
        rid = r.request_id
        with self.cond:
            first = self._version
            self.arrived.add(rid)
            self.active.append(rid)
            self.max_active = max(self.max_active, len(self.active))
            self.cond.notify_all()
        try:
            if rid in self.arrival:
                other = self.arrival[rid]
                await asyncio.to_thread(self._wait, lambda: other in self.arrived, f"{rid}: {other} to arrive")
            if rid in self.hold:
                need = self.hold[rid]
                await asyncio.to_thread(self._wait, lambda: self._version >= need, f"{rid}: version {need}")
            if rid in self.after:
                other = self.after[rid]
                await asyncio.to_thread(self._wait, lambda: other in self.finished, f"{rid}: {other} to finish")
            if self.held_by_test(rid):
                await asyncio.to_thread(self._wait, lambda: rid in self.released, f"{rid}: released")
            with self.cond:
                last = self._version
        finally:
            with self.cond:
                self.active.remove(rid)
                self.finished.add(rid)
                self.cond.notify_all()
        comps = []
        for i in range(r.n):
            n = i + 3  # lengths differ within a group: rewards vary, no group is filtered
            versions = [first] * 2 + [last] * (n - 2)
            comps.append(
                Completion([5] * n, [-0.5] * n, "stop", first, "x" * n, versions=versions if last != first else None)
            )
        return comps

    def release(self, *rids: str) -> None:
        with self.cond:
            self.released.update(rids)
            self.cond.notify_all()

    def update_weights(self, version: int) -> None:
        if version in self.loads_after:
            first = self.loads_after[version]
            self._wait(lambda: first in self.finished, f"version {version}: {first} to finish first")
        with self.cond:
            self.updates.append(version)
            self.in_flight_at_update[version] = list(self.active)
            self._version = version
            self.cond.notify_all()

    @property
    def policy_version(self) -> int:
        return self._version

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()


class StepTrainer:
    """The fake trainer; ``on_step(k)`` runs inside each train step (k from 0)."""

    def __init__(self, on_step: Callable[[int], None] | None = None) -> None:
        self.on_step = on_step or (lambda k: None)
        self.batches: list[Any] = []
        self.calls: list[str] = []

    def train_step(self, batch: Any) -> dict[str, float]:
        self.on_step(len(self.batches))
        self.batches.append(batch)
        return {}

    def export_weights(self, version: int) -> Any:
        return object()

    def save(self, path: Path) -> None:
        (path / "trainer.txt").write_text("state")

    def load(self, path: Path) -> None:
        self.calls.append("load")


class Run:
    """One loop run: its summary, metric rows, the batches the loop took (in step order)."""

    def __init__(self, tmp_path: Path, generator: Generator, *, steps: int, trainer: StepTrainer | None = None,
                 task: FakeTask | None = None, clock: Callable[[], float] | None = None, **loop: Any) -> None:
        loop_options = {"overlap": "continuous", "max_staleness": 1, **loop}
        config = RunConfig.model_validate(
            {
                "generator": {"name": "fake"},
                "loop": {
                    "steps": steps,
                    "prompts_per_step": P,
                    "group_size": GROUP,
                    "eval_at_start": False,
                    "sampling": {"max_tokens": 8},
                    **loop_options,
                },
                "transport": {"timeout": 30},
                "logging": {"tensorboard": False, "progress": False},
            }
        )
        self.trainer = trainer or StepTrainer()
        self.task = task or FakeTask()
        self.loop = Loop(config, build_registry(), RunContext.for_run(config, tmp_path), TrainerDriver(self.trainer, 1),
                         generator, self.task, FakeRewards(), FakeSender(), FakeTokenizer())  # fmt: skip
        if clock is not None:
            self.loop.idle = IdleClock(clock)
        self.taken: list[RolloutBatch] = []
        make = self.loop.rollouts

        def rollouts(source, pending):
            buffer, producer = make(source, pending)
            get = buffer.get

            def recorded(index: int, timeout: float | None = None) -> RolloutBatch:
                # A deadline: an overlap that deadlocks fails here rather than hanging.
                batch = get(index, scaled(60))
                self.taken.append(batch)
                return batch

            buffer.get = recorded  # type: ignore[method-assign]
            return buffer, producer

        self.loop.rollouts = rollouts  # type: ignore[method-assign]
        self.tmp_path = tmp_path

    def run(self) -> Run:
        self.summary = self.loop.run()
        lines = (self.tmp_path / "metrics.jsonl").read_text().splitlines()
        self.rows = [json.loads(line) for line in lines]
        return self

    def problems(self) -> list[list[str]]:
        """Each taken batch's problems, one per group, in the batch's order."""
        return [list(dict.fromkeys(e.problem.id for e in b.episodes)) for b in self.taken]


def _ids(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


def _flat(batches: list[list[str]]) -> list[str]:
    return [p for b in batches for p in b]


# ------------------------------------------------------------------- updates and batches


def test_updates_are_not_held_back_and_batches_form_in_completion_order(tmp_path):
    # The first group (p0) finishes only once version 1 is served: the versioned loop would
    # wait for it before that update, forever. Here its batch-mates go on without it. Every
    # order the test checks is forced, none hoped for: p2 finishes only once p3 has arrived
    # (so p3 is sampled at version 0: a loaded CI run once sent p3 after version 1 was
    # loaded), p3 after p2, p0 after p3, and the third batch after p0, p5 after p4. Version
    # 1 loads only once p3 has finished, so that p3 is sampled by version 0 to the end
    # (nothing else stops p3's last tokens from coming after the update, once batch 0 is
    # trained: then only its first two tokens would be one version old).
    gen = GatedGenerator(
        hold={"b0-g0": 1},
        arrival={"b1-g0": "b1-g1"},
        after={"b1-g1": "b1-g0", "b0-g0": "b1-g1", "b2-g0": "b0-g0", "b2-g1": "b2-g0"},
        loads_after={1: "b1-g1"},
    )
    run = Run(tmp_path, gen, steps=3).run()
    assert run.summary["status"] == "completed" and run.summary["steps"] == 3
    assert gen.updates == [1, 2, 3]
    assert "b0-g0" in gen.in_flight_at_update[1], "version 1 was loaded with p0's request in flight"
    # In admission order the batches would be p0 p1 | p2 p3 | p4 p5.
    assert run.problems() == [["p1", "p2"], ["p3", "p0"], ["p4", "p5"]], "completion order"
    for e in run.taken[1].episodes:
        if e.problem.id == "p0":  # sampled across the update: its tokens say so
            assert e.completion.versions is not None and e.completion.versions[:3] == [0, 0, 1]
    assert [r["samples/dropped_stale"] for r in run.rows] == [0, 0, 0], "p0 is one version old: allowed"
    assert [r["staleness/tokens_age_1"] for r in run.rows][1] == 2 * GROUP + sum(range(3, 3 + GROUP)), (
        "batch 1: p3's tokens (version 0) and p0's first two tokens are one version old"
    )


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_a_group_that_finishes_too_late_is_dropped_or_masked_and_counted(tmp_path, mode):
    # p0 starts at version 0 and finishes at version 2, so it is trained at version 2 or 3:
    # its first two tokens are 2 or more versions old, over max_staleness 1. p0 also waits
    # for p5 (b2-g1), so that their batch's order is fixed (CI once saw p0 finish first);
    # for the same reason p7 waits for p6, which waits for p0 (a loaded run once saw p7 first).
    gen = GatedGenerator(hold={"b0-g0": 2}, after={"b0-g0": "b2-g1", "b3-g0": "b0-g0", "b3-g1": "b3-g0"})
    run = Run(tmp_path, gen, steps=4, stale_samples=mode).run()
    assert run.summary["status"] == "completed"
    assert run.problems() == [["p1", "p2"], ["p3", "p4"], ["p5", "p0"], ["p6", "p7"]]
    late = 2
    dropped = [r["samples/dropped_stale"] for r in run.rows]
    masked = [r["staleness/tokens_masked"] for r in run.rows]
    if mode == "drop":
        assert dropped[late] == GROUP and sum(dropped) == GROUP, dropped
        assert sum(masked) == 0
    else:
        assert sum(dropped) == 0 and masked[late] == 2 * GROUP and sum(masked) == 2 * GROUP, masked
    assert sum(r["samples/trained"] for r in run.rows) == 4 * P * GROUP - (GROUP if mode == "drop" else 0)


def test_a_failed_group_ends_the_run_with_its_error(tmp_path):
    from forgerl.errors import GeneratorError

    class Failing(GatedGenerator):
        async def _one(self, r):
            if r.request_id == "b1-g0":
                raise GeneratorError("replica gone")
            return await super()._one(r)

    with pytest.raises(GeneratorError, match="replica gone"):
        Run(tmp_path, Failing(), steps=3).run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"


# ------------------------------------------------------------------- the in-flight cap


def test_the_in_flight_cap_is_reached_and_never_exceeded():
    """The producer alone, against a generator that holds every request until the test
    releases it: three groups in flight (the cap, below the four the staleness bound would
    admit), then one more each time one finishes, then the staleness bound."""
    cap = 3
    gen = GatedGenerator(held_by_test=lambda rid: True)
    task = FakeTask()
    buffer = ContinuousBuffer(prompts_per_step=P, max_staleness=1, max_in_flight=cap, next_index=0, version=0,
                              task_state=task.state_dict(), requeued=[])  # fmt: skip
    producer = ContinuousProducer(
        buffer=buffer, generator=gen, source=ProblemSource(task), score=FakeRewards().score,
        tokenizing=Tokenizing(FakeTokenizer()), group_size=GROUP, sampling=SamplingParams(), seed=0,
        last_group=4 * P - 1,
    )  # fmt: skip
    producer.start()
    try:

        def state() -> tuple[str | None, list[str]]:
            with gen.cond:
                return buffer.waiting_for, list(gen.active)

        wait_until(lambda: state() == ("room", ["b0-g0", "b0-g1", "b1-g0"]), 30, "three requests, then the cap")
        gen.release("b0-g1")
        wait_until(lambda: state() == ("room", ["b0-g0", "b1-g0", "b1-g1"]), 30, "one more once one finished")
        gen.release("b0-g0")
        # Group 4 belongs to batch 2, which needs version 1 (staleness 1): not yet. The
        # producer reaches that gate as soon as p0's generation is done, which may be before
        # p0 is scored and batch 0 formed: wait for both.
        wait_until(lambda: state() == ("version", ["b1-g0", "b1-g1"]), 30, "the staleness bound")
        wait_until(lambda: 0 in buffer.ready, 30, "batch 0 formed once p0 is scored")
        assert [b.index for b in buffer.ready.values()] == [0]
        assert [e.problem.id for e in buffer.ready[0].episodes][::GROUP] == ["p1", "p0"], "completion order"
        buffer.set_version(1)
        wait_until(lambda: state() == ("room", ["b1-g0", "b1-g1", "b2-g0"]), 30, "the cap again")
        assert gen.max_active == cap
    finally:
        buffer.stop()
        gen.close()
        producer.join(scaled(30))
    assert not producer.is_alive()


def test_the_default_cap_is_what_the_staleness_bound_admits():
    assert default_in_flight(8, 1) == 16 and default_in_flight(8, 2) == 24


# ------------------------------------------------------------------- resume


@pytest.mark.parametrize("resumed_as", ["continuous", "versioned"])
def test_a_resume_neither_skips_nor_repeats_a_problem(tmp_path, resumed_as):
    """The run is stopped after step 2 while p0's group is still generating (it waits for
    version 3): the checkpoint hands p0 (and whatever else was drawn but not in a finished
    batch) back, and the resumed run trains it: every problem exactly once over both runs,
    and no problem drawn from the task twice."""
    first: Run

    def stop_after_second(k: int) -> None:
        if k == 1:
            first.loop.stop_requested.set()

    gen = GatedGenerator(hold={"b0-g0": 3})
    first = Run(tmp_path, gen, steps=4, trainer=StepTrainer(stop_after_second))
    try:
        first.run()
    finally:
        gen.close()
    assert first.summary["status"] == "interrupted" and first.summary["steps"] == 2
    loop_state = json.loads((tmp_path / "checkpoints" / "step-000002" / "loop.json").read_text())
    requeued = [p["id"] for p in loop_state["task_state"][REQUEUED]]
    assert "p0" in requeued, requeued
    pending = {e["problem"]["id"] for b in loop_state["pending_rollouts"] for e in b["episodes"]}
    # Every problem the task gave out is trained, in a saved batch, or handed back.
    drawn = loop_state["task_state"]["served"]
    assert sorted([*_flat(first.problems()[:2]), *pending, *requeued]) == sorted(_ids(drawn))

    task = FakeTask()
    second = Run(tmp_path, GatedGenerator(), steps=4, task=task, overlap=resumed_as).run()
    assert "load" in second.trainer.calls, "the second run should have resumed from the checkpoint"
    assert second.summary["status"] == "completed" and second.summary["steps"] == 4
    trained = first.problems()[:2] + second.problems()
    assert len(trained) == 4
    assert sorted(_flat(trained)) == _ids(4 * P), trained
    assert task.served == 4 * P, "the resumed run drew nothing new from the task: the requeue covered it"


def test_a_damaged_requeue_in_a_checkpoint_is_named():
    from forgerl.rollouts.problem_source import split, with_requeued
    from forgerl.types import Problem

    with pytest.raises(ValueError, match=r"\[0\]: .*lacks answer"):
        split({REQUEUED: [{"id": "p", "prompt": "q", "metadata": {}}]})
    with pytest.raises(ValueError, match="must be a list"):
        split({REQUEUED: "p0"})
    assert split({"served": 3}) == ({"served": 3}, [])
    problems = [Problem("a", [{"role": "user", "content": "q"}], "1", {"k": [1, 2]})]
    assert with_requeued({"served": 3}, []) == {"served": 3}, "nothing requeued: the task's state as it was"
    assert split(with_requeued({"served": 3}, problems)) == ({"served": 3}, problems)


# ------------------------------------------------------------------- idle fraction


def test_the_idle_clock_adds_up_the_time_with_no_call_in_flight():
    now = [0.0]
    clock = IdleClock(lambda: now[0])
    start = clock.mark()
    now[0] = 2.0
    clock.begin()  # idle 0-2
    now[0] = 3.0
    clock.begin()  # two calls in flight
    now[0] = 4.0
    clock.end()
    now[0] = 5.0
    clock.end()  # busy 2-5
    now[0] = 10.0  # idle 5-10
    assert clock.idle_frac(start) == pytest.approx(0.7)
    middle = clock.mark()
    clock.begin()
    assert clock.idle_frac(middle) == 0.0, "no time passed, a call in flight"
    now[0] = 12.0
    assert clock.idle_frac(middle) == 0.0


def test_the_watched_generator_counts_its_calls_in_flight():
    now = [0.0]
    clock = IdleClock(lambda: now[0])
    inner = FakeGenerator()

    class Slow(FakeGenerator):
        async def generate(self, requests):
            now[0] += 4.0  # the call takes 4 s of the fake clock
            return await inner.generate(requests)

    watched = WatchedGenerator(Slow(), clock)
    start = clock.mark()
    now[0] = 1.0
    from forgerl.types import GenerationRequest

    asyncio.run(watched.generate([GenerationRequest("r", [1], 1, SamplingParams())]))
    now[0] = 6.0
    assert clock.idle_frac(start) == pytest.approx(2 / 6)
    assert watched.policy_version == 0


class FakeClock:
    """Time moves only when the trainer trains (10 s a step): a step's idle share is the
    share of its training time in which no generation request was in flight."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_versioned_loop_idles_the_generator_while_it_trains(tmp_path):
    clock = FakeClock()

    def train(k: int) -> None:
        clock.now += 10.0

    run = Run(tmp_path, FakeGenerator(), steps=3, trainer=StepTrainer(train), clock=clock,
              overlap="versioned", max_staleness=0).run()  # fmt: skip
    # Staleness 0: batch k+1 waits for version k+1, so nothing generates during a step.
    assert [r["time/generator_idle_frac"] for r in run.rows] == [1.0, 1.0, 1.0]


def test_the_continuous_loop_generates_while_it_trains(tmp_path):
    """Each step trains while the next batch's groups are being generated (the trainer
    waits, with a deadline, until they are in flight, then lets them finish)."""
    clock = FakeClock()
    steps = 3
    gen = GatedGenerator(held_by_test=lambda rid: rid.startswith("b") and not rid.startswith("b0-"))

    def train(k: int) -> None:
        if k < steps - 1:  # the last step has nothing left to generate
            nxt = [f"b{k + 1}-g{g}" for g in range(P)]
            wait_until(lambda: all(r in gen.active for r in nxt), 30, f"batch {k + 1}'s groups in flight")
            clock.now += 10.0
            gen.release(*nxt)
        else:
            clock.now += 10.0

    run = Run(tmp_path, gen, steps=steps, trainer=StepTrainer(train), clock=clock).run()
    assert [r["time/generator_idle_frac"] for r in run.rows] == [0.0, 0.0, 1.0]


# ------------------------------------------------------------------- options


def _config(**loop: Any) -> RunConfig:
    return RunConfig.model_validate({"loop": loop})


def test_continuous_needs_staleness():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"set loop.max_staleness=1 \(or more\), or loop.overlap=versioned"):
        _config(overlap="continuous", max_staleness=0)
    assert _config(overlap="continuous", max_staleness=1).loop.overlap == "continuous"
    assert RunConfig().loop.overlap == "versioned", "the default stays the reproducible mode"


def test_max_in_flight_only_with_continuous_and_in_range():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_in_flight bounds overlap continuous only"):
        _config(max_in_flight=4)
    with pytest.raises(ValidationError, match="max_in_flight"):
        _config(overlap="continuous", max_staleness=1, max_in_flight=0)
    with pytest.raises(ValidationError, match="overlap"):
        _config(overlap="sometimes")


def test_continuous_is_for_single_turn_rollouts():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="single-turn prompt groups only"):
        RunConfig.model_validate(
            {"loop": {"overlap": "continuous", "max_staleness": 1}, "environment": {"name": "calculator"}}
        )


@pytest.mark.parametrize(
    "generator, options, said",
    [
        ("vllm", {}, "which update_policy 'wait' does not: set generator.options.update_policy=keep"),
        ("vllm", {"update_policy": "abort"}, "update_policy 'abort' does not"),
        ("hf", {}, "generator 'hf' cannot (it has no update_policy keep): use --generator vllm"),
        ("sglang", {}, "which update_policy 'wait' does not: set generator.options.update_policy=keep"),
    ],
)
def test_continuous_needs_a_generator_that_updates_in_flight(generator, options, said):
    from forgerl.errors import ConfigError
    from forgerl.registry.resolve import resolve

    config = RunConfig.model_validate({
        "generator": {"name": generator, "options": options},
        "loop": {"overlap": "continuous", "max_staleness": 1},
    })  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve(config, build_registry())
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_continuous_with_keep_resolves():
    from forgerl.registry.resolve import resolve

    config = RunConfig.model_validate({
        "generator": {"name": "vllm", "options": {"update_policy": "keep"}},
        "loop": {"overlap": "continuous", "max_staleness": 2},
    })  # fmt: skip
    assert resolve(config, build_registry()).loop.overlap == "continuous"


def test_the_cli_refuses_continuous_without_keep_in_one_line(tmp_path):
    from .test_cli import assert_one_line_error, forge

    cfg = tmp_path / "run.yaml"
    cfg.write_text("generator:\n  name: vllm\nloop:\n  overlap: continuous\n  max_staleness: 1\n")
    assert_one_line_error(forge("config", "validate", str(cfg)), "set generator.options.update_policy=keep")
    cfg.write_text("loop:\n  overlap: continuous\n")
    assert_one_line_error(forge("config", "validate", str(cfg)), "set loop.max_staleness=1")
