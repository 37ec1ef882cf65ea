"""Update policy ``keep``: per-token versions of completions that ran across an update
(:mod:`forgerl_plugins.generators.common.crossings`) and what the updater does around
the load (:mod:`forgerl_plugins.generators.common.updates`), against a recording engine.
The real engines are covered by tests/integration/test_vllm.py (vLLM) and
tests/integration/test_sglang_double.py (the SGLang double)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from forgerl.errors import TransportError
from forgerl.types import Completion
from forgerl_plugins.generators.common.crossings import Crossing, Flight, label
from forgerl_plugins.generators.common.replica import Replica
from forgerl_plugins.generators.common.updates import WeightUpdater


def completion(n: int, version: int = 3) -> Completion:
    return Completion(list(range(n)), [-0.5] * n, "length", version)


def test_a_completion_across_an_update_is_labelled_at_the_token_the_engine_reported():
    flight = Flight("req-1", 3, [Crossing({0: 4, 1: 0}, 4)])
    first, second = completion(6), completion(2)
    label([first, second], flight)
    assert first.versions == [3, 3, 3, 3, 4, 4] and first.policy_version == 3  # staleness from the oldest
    assert second.versions == [4, 4] and second.policy_version == 3  # not started at the pause


def test_two_updates_and_a_choice_the_engine_never_started():
    flight = Flight("req-1", 3, [Crossing({0: 2}, 4), Crossing({0: 5}, 5)])
    c, late = completion(7), completion(3)
    label([c, late], flight)  # choice 1 absent from both counts: all of it sampled by 5
    assert c.versions == [3, 3, 4, 4, 4, 5, 5]
    assert late.versions == [5, 5, 5]


def test_a_completion_finished_before_the_pause_keeps_one_version_and_no_versions_list():
    flight = Flight("req-1", 3, [Crossing({0: 5}, 4)])
    done = completion(5)
    label([done], flight)
    assert done.versions is None and done.policy_version == 3
    untouched = completion(5)
    label([untouched], Flight("req-2", 3))
    assert untouched.versions is None


def test_greedy_copies_take_choice_zeros_count():
    flight = Flight("req-1", 3, [Crossing({0: 1}, 4)])
    copies = [completion(3), completion(3)]
    label(copies, flight, choices=[0, 0])
    assert [c.versions for c in copies] == [[3, 4, 4], [3, 4, 4]]


class RecordingEngine:
    """Answers like a paused engine; records the calls in order."""

    role, label = "fake", "Fake"

    def __init__(self, counts: dict[str, dict[int, int]], fail: str | None = None) -> None:
        self.counts = counts
        self.fail = fail  # "before" (weights intact) or "half-way" (touched)
        self.calls: list[tuple[str, str]] = []

    async def stage(self, r: Replica, version: int) -> None:
        self.calls.append(("stage", str(version)))

    async def pause(self, r: Replica, policy: str) -> None:
        self.calls.append(("pause", policy))

    async def sampled_so_far(self, r: Replica, keys: list[str]) -> dict[str, dict[int, int]]:
        self.calls.append(("sampled_so_far", ",".join(sorted(keys))))
        return {k: v for k, v in self.counts.items() if k in keys}

    async def load(self, r: Replica, version: int) -> None:
        self.calls.append(("load", str(version)))
        if self.fail == "half-way":
            r.version = None
        if self.fail:
            raise TransportError("load failed")

    async def resume(self, r: Replica, policy: str) -> None:
        self.calls.append(("resume", policy))


def run_update(tmp_path: Path, engine: RecordingEngine, flights: list[Flight]) -> tuple[Replica, BaseException | None]:
    r = Replica(0, tmp_path / "log", tmp_path / "fake-0.json", "fake")
    r.up, r.version, r.instance = True, 3, "i1"
    r.flights = {f.key: f for f in flights}

    async def notify() -> None:
        pass

    async def go() -> BaseException | None:
        updater = WeightUpdater(engine, [r], policy="keep", retry_after=1.0, notify=notify)  # type: ignore[arg-type]
        updater.version = 3
        try:
            await updater.update(4)
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None

    return r, asyncio.run(go())


def test_keep_pauses_in_place_counts_loads_then_resumes_and_records_the_crossing(tmp_path: Path):
    running, waiting = Flight("a", 3), Flight("b", 3)
    engine = RecordingEngine({"a": {0: 7, 1: 2}})
    r, error = run_update(tmp_path, engine, [running, waiting])
    assert error is None
    # The version is staged while the replica still generates: the pause holds only the load.
    assert engine.calls == [
        ("stage", "4"), ("pause", "keep"), ("sampled_so_far", "a,b"), ("load", "4"), ("resume", "keep")
    ]  # fmt: skip
    assert running.crossings == [Crossing({0: 7, 1: 2}, 4)]
    assert waiting.crossings == [Crossing({}, 4)]  # not started: everything after the resume
    assert r.version == 4 and r.aborts == 0 and not r.updating


@pytest.mark.parametrize("fail", ["before", "half-way"])
def test_a_failed_load_under_keep_records_no_crossing(tmp_path: Path, fail: str):
    flight = Flight("a", 3)
    engine = RecordingEngine({"a": {0: 7}}, fail=fail)
    r, error = run_update(tmp_path, engine, [flight])
    assert isinstance(error, TransportError)
    assert flight.crossings == []
    if fail == "before":  # the old weights are intact: the frozen requests go on with them
        assert r.aborts == 0 and ("pause", "abort") not in engine.calls
    else:  # weights nobody can name: what was frozen is aborted (and the pool resubmits it)
        assert r.aborts == 1 and engine.calls[-2:] == [("pause", "abort"), ("resume", "keep")]
    assert engine.calls[-1] == ("resume", "keep") and not r.updating


def test_a_replica_taken_out_while_paused_is_still_resumed(tmp_path: Path):
    """Under keep a request of ours may time out on the frozen engine while the load runs,
    and the pool takes the replica out for it: the update still resumes the server (the
    watcher puts a server that answers /health back in service, and a paused one would
    hold every request sent to it)."""

    class TimedOutDuringLoad(RecordingEngine):
        async def load(self, r: Replica, version: int) -> None:
            await super().load(r, version)
            r.take_out("request a: ReadTimeout")  # what the pool does for a failed request

    engine = TimedOutDuringLoad({"a": {0: 7}})
    r, error = run_update(tmp_path, engine, [Flight("a", 3)])
    assert error is None and r.version == 4
    assert engine.calls[-2:] == [("load", "4"), ("resume", "keep")], engine.calls
    assert not r.up and not r.updating  # back in service once the watcher finds it healthy


class DyingEngine(RecordingEngine):
    """Replica 1's server dies once it is paused, before ``dies_at`` ("counts": vLLM's
    sampled_so_far; "load"): it answers nothing from then on."""

    def __init__(self, counts: dict[str, dict[int, int]], dies_at: str) -> None:
        super().__init__(counts)
        self.dies_at = dies_at

    def _dead(self, r: Replica, step: str) -> None:
        import httpx

        if r.index == 1 and step == self.dies_at:
            raise httpx.ConnectError("connection refused")

    async def sampled_so_far(self, r: Replica, keys: list[str]) -> dict[str, dict[int, int]]:
        self._dead(r, "counts")
        return await super().sampled_so_far(r, keys)

    async def load(self, r: Replica, version: int) -> None:
        self._dead(r, "load")
        await super().load(r, version)
        r.version = version


@pytest.mark.parametrize("dies_at", ["counts", "load"])
def test_a_replica_that_dies_mid_update_under_keep_is_taken_out_and_the_others_go_on(tmp_path: Path, dies_at: str):
    """Its requests fail over (the pool resubmits what failed on a replica taken out, see
    tests/integration/test_sglang_double.py for the requests themselves); the update
    stands on the replica that loaded it, whose frozen requests go on labelled."""
    replicas, flights = [], []
    for i in range(2):
        r = Replica(i, tmp_path / f"log{i}", tmp_path / f"fake-{i}.json", "fake")
        r.up, r.version, r.instance = True, 3, f"i{i}"
        flight = Flight(f"q{i}", 3)
        r.flights = {flight.key: flight}
        replicas.append(r)
        flights.append(flight)
    engine = DyingEngine({"q0": {0: 5}, "q1": {0: 6}}, dies_at)

    async def notify() -> None:
        pass

    async def go() -> WeightUpdater:
        updater = WeightUpdater(engine, replicas, policy="keep", retry_after=1.0, notify=notify)  # type: ignore[arg-type]
        updater.version = 3
        await updater.update(4)  # raises nothing: replica 0 loaded it, replica 1 is unreachable
        return updater

    updater = asyncio.run(go())
    alive, dead = replicas
    assert updater.version == 4 and updater.last_update["replicas"] == [0]
    assert alive.version == 4 and alive.up and flights[0].crossings == [Crossing({0: 5}, 4)]
    assert not dead.up and dead.version is None and flights[1].crossings == []  # reloaded before it serves
    assert ("resume", "keep") in engine.calls and engine.calls.count(("resume", "keep")) == 1  # the live one only
    assert not alive.updating and not dead.updating and alive.aborts == dead.aborts == 0


def test_vllm_internal_request_ids_map_back_to_ours():
    from forgerl_plugins.generators.vllm.worker_extension import _our_request

    keys = {"step3_p1-0a1b2c3d", "r-9-ffff0000"}
    assert _our_request("cmpl-step3_p1-0a1b2c3d-0-1234abcd", keys) == ("step3_p1-0a1b2c3d", 0)
    assert _our_request("2_cmpl-step3_p1-0a1b2c3d-0-1234abcd", keys) == ("step3_p1-0a1b2c3d", 2)
    assert _our_request("cmpl-r-9-ffff0000-0-00000000", keys) == ("r-9-ffff0000", 0)
    assert _our_request("cmpl-someone-else-0-1234abcd", keys) is None


def test_a_replica_serves_only_the_generators_version_or_the_one_an_update_is_loading(tmp_path: Path):
    """A server met holding another version (an earlier generator's adapter version 2, where
    this one starts at 0) takes no request until the watcher reloads it: its completions
    would report a version the run never sent, sampled with weights it does not hold."""
    done, behind = (Replica(i, tmp_path / f"log{i}", tmp_path / f"fake-{i}.json", "fake") for i in range(2))
    for r in (done, behind):
        r.up, r.instance = True, f"i{r.index}"

    async def notify() -> None:
        pass

    updater = WeightUpdater(RecordingEngine({}), [done, behind], policy="wait", retry_after=1.0, notify=notify)  # type: ignore[arg-type]
    done.version, behind.version = 2, 0
    assert not updater.serves(done) and updater.serves(behind)  # newer than the generator's 0
    updater.version, updater.loading = 1, 2  # mid-update: replica 0 has 2, replica 1 still 1
    behind.version = 1
    assert updater.serves(done) and updater.serves(behind)
    updater.loading = None
    assert not updater.serves(done)
    done.version = 1
    done.updating = True
    assert not updater.serves(done)
