"""A server generator's pool when its replicas are out of service (the shared pool of the
vllm and sglang generators: forgerl_plugins.generators.common.pool).

A request that failed on a replica must not be sent there again while the replica cannot
answer: its ``/health`` may answer while its engine is wedged (vLLM's API server does), so
the replica is back only once its launcher saw its engine answer again, or once another
server replaced it. Meanwhile the request waits for a replica, as long as a restart may
take, and failures on servers that were replaced do not count against it; a request that
fails on servers that stay is still given up.

A fake engine stands in for vLLM here (no server); the endpoint files and the launcher's
answer counts are the real files a launcher writes (forgerl_plugins.serving.service).
The same rule on a real vLLM server: tests/faults/test_generator_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from forgerl.errors import GeneratorError, GeneratorUnreachable
from forgerl.interfaces import RunContext
from forgerl.types import Completion, GenerationRequest, SamplingParams
from forgerl_plugins.generators.common.pool import ReplicaFailed, ReplicaPool
from forgerl_plugins.serving.launcher import endpoint_file
from forgerl_plugins.serving.service import AnswerCount, Outage, read_answers, restart_allowance

from ..helpers.timing import scaled, wait_until

ROLE = "fake"
HEALTH_INTERVAL = 0.02


class FakeClient:
    """``/health`` answers, as vLLM's API server does with its engine stopped. Time passes
    between two health checks: the launcher's probes of a live engine (``live``) answer."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.checks = 0

    async def healthy(self, r) -> bool:
        self.checks += 1
        if r.instance in self.engine.live:
            self.engine.engine_answers(r.instance, 1)
        return True

    async def aclose(self) -> None:
        pass


class FakeEngine:
    """Each server instance answers as ``behaviour[instance]`` says: "ok", "wedged" (the
    request times out), "dies" (the connection breaks, and the next instance takes its
    place), or "poison" (HTTP 500 every time, while its engine answers its launcher)."""

    role, label = ROLE, "Fake"

    def __init__(self, run_dir: Path, behaviour: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.behaviour = behaviour
        self.sent: list[str] = []  # the instance each request went to, in order
        self.live: set[str] = {i for i, what in behaviour.items() if what == "poison"}
        self.client = FakeClient(self)
        self.counts: dict[str, AnswerCount] = {}

    # ---- the test's hands on the "servers"
    def start(self, instance: str) -> None:
        """A server (re)started by its launcher: its answer count, then its endpoint."""
        endpoint = endpoint_file(self.run_dir, ROLE, 0)
        self.counts[instance] = AnswerCount(endpoint, instance)
        self.counts[instance].publish()
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        endpoint.write_text(json.dumps({"host": "127.0.0.1", "port": 9, "instance": instance, "api_key": "k"}))

    def engine_answers(self, instance: str, times: int) -> None:
        for _ in range(times):
            self.counts[instance].add()

    # ---- the Engine protocol
    def connect(self, connections: int) -> None:
        pass

    async def introduce(self, r) -> None:
        if not r.probed:
            r.version, r.probed = 0, True

    async def send(self, r, request: GenerationRequest, version: int) -> list[Completion]:
        self.sent.append(r.instance)
        what = self.behaviour[r.instance]
        if what == "wedged":
            raise httpx.ReadTimeout("timed out")
        if what == "dies":
            following = f"i{int(r.instance[1:]) + 1}"
            self.start(following)  # its launcher's restart
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if what == "poison":
            raise ReplicaFailed("HTTP 500: internal error")  # only this request fails
        return [Completion([5], [-0.5], "stop", version, "x")]

    def close(self) -> None:
        pass


def _pool(tmp_path: Path, engine: FakeEngine, **limits: float) -> ReplicaPool:
    options = SimpleNamespace(
        replicas=1, max_concurrency=4, startup_timeout=limits.get("startup_timeout", scaled(30)),
        liveness_timeout=60.0, health_interval=HEALTH_INTERVAL, update_policy="wait",
    )  # fmt: skip
    return ReplicaPool(engine, options, context=RunContext(run_dir=tmp_path))  # type: ignore[arg-type]


def _request() -> GenerationRequest:
    return GenerationRequest("b5-g5", [1, 2, 3], 1, SamplingParams(max_tokens=4))


class Generating:
    """``pool.generate([request])`` on a thread of its own: its result or its error."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.result: list | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(pool,), daemon=True)
        self.thread.start()

    def _run(self, pool: ReplicaPool) -> None:
        try:
            self.result = asyncio.run(pool.generate([_request()]))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def join(self) -> None:
        self.thread.join(scaled(30))
        assert not self.thread.is_alive(), "generate() did not return"


def _health_checks_after(engine: FakeEngine, n: int) -> None:
    """Let the pool's watcher look at the replica ``n`` more times (each look may put the
    replica back in service and hand it a waiting request)."""
    start = engine.client.checks
    wait_until(lambda: engine.client.checks >= start + n, scaled(30), f"{n} more health checks")


def test_a_request_waits_for_the_replacement_of_a_replica_whose_engine_is_wedged(tmp_path: Path):
    """One replica, its engine wedged behind an API server that answers /health: the
    request that timed out there is not sent to it again (before: twice more, then the run
    failed while the replacement was starting); it goes to the restarted server."""
    engine = FakeEngine(tmp_path, {"i0": "wedged", "i1": "ok"})
    engine.start("i0")
    pool = _pool(tmp_path, engine)
    try:
        call = Generating(pool)
        wait_until(lambda: engine.sent, scaled(30), "the request on the wedged replica")
        _health_checks_after(engine, 10)
        assert engine.sent == ["i0"] and call.error is None, (engine.sent, call.error)
        assert "waiting for its engine" in pool.health().detail
        engine.start("i1")  # the launcher killed the hung server; the scheduler restarted it
        call.join()
        assert call.error is None, call.error
        assert engine.sent == ["i0", "i1"]
        assert call.result is not None and call.result[0][0].token_ids == [5]
    finally:
        pool.close()


def test_a_replica_whose_engine_answers_its_launcher_again_is_back_in_service(tmp_path: Path):
    """A request timed out on a slow but live engine: once its launcher has seen the
    engine answer twice since (one answer may come from a probe begun before the
    failure), the replica takes the request again."""
    engine = FakeEngine(tmp_path, {"i0": "wedged"})
    engine.start("i0")
    pool = _pool(tmp_path, engine)
    try:
        call = Generating(pool)
        wait_until(lambda: "waiting for its engine" in pool.health().detail, scaled(30),
                   "the replica out of service after the request timed out there")  # fmt: skip
        engine.behaviour["i0"] = "ok"
        engine.engine_answers("i0", 1)
        _health_checks_after(engine, 10)
        assert engine.sent == ["i0"], "back in service on one answer, which may predate the failure"
        engine.engine_answers("i0", 1)
        call.join()
        assert call.error is None and engine.sent == ["i0", "i0"], (call.error, engine.sent)
    finally:
        pool.close()


def test_failures_on_servers_that_were_replaced_do_not_count_against_the_request(tmp_path: Path):
    """The only replica dies under the request four times (more than the 3 attempts one
    replica gives a request), and restarts each time: the request is answered by the fifth
    server. How often a server may restart is the scheduler's max_restarts."""
    engine = FakeEngine(tmp_path, {"i0": "dies", "i1": "dies", "i2": "dies", "i3": "dies", "i4": "ok"})
    engine.start("i0")
    pool = _pool(tmp_path, engine)
    try:
        call = Generating(pool)
        call.join()
        assert call.error is None, call.error
        assert engine.sent == ["i0", "i1", "i2", "i3", "i4"]
    finally:
        pool.close()


def test_a_request_that_fails_on_a_server_that_stays_is_given_up(tmp_path: Path):
    """A request the live server answers with HTTP 500 every time is not retried forever:
    three attempts on one replica, then one line naming them."""
    engine = FakeEngine(tmp_path, {"i0": "poison"})
    engine.start("i0")
    pool = _pool(tmp_path, engine)
    try:
        call = Generating(pool)
        call.join()
        assert isinstance(call.error, GeneratorError), call.error
        message = str(call.error)
        assert "request 'b5-g5' failed on every Fake replica (3 attempts)" in message, message
        assert "HTTP 500" in message and "\n" not in message
        assert engine.sent == ["i0", "i0", "i0"]
    finally:
        pool.close()


def test_the_wait_for_a_replica_ends_when_a_restart_would_have(tmp_path: Path):
    engine = FakeEngine(tmp_path, {"i0": "wedged"})
    engine.start("i0")
    pool = _pool(tmp_path, engine)
    pool.out_of_service_limit = 0.5  # as if a restart could take that long
    try:
        call = Generating(pool)
        call.join()
        assert isinstance(call.error, GeneratorUnreachable), call.error
        message = str(call.error)
        assert "no Fake replica has served for 0.5 s (as long as a restart may take)" in message, message
        assert "replica 0 down" in message and "ReadTimeout" in message and "waiting for its engine" in message
        assert engine.sent == ["i0"]
    finally:
        pool.close()


def test_the_wait_lasts_as_long_as_a_restart_may_take(tmp_path: Path):
    """Liveness timeout and one more probe (the launcher finds the server hung), start-up
    (the new server answers), a weight load and one retry of it (re-sync)."""
    engine = FakeEngine(tmp_path, {"i0": "ok"})
    engine.start("i0")
    pool = _pool(tmp_path, engine, startup_timeout=300.0)
    try:
        retry = 10 * HEALTH_INTERVAL
        assert pool.out_of_service_limit == pytest.approx(60.0 + 10.0 + 300.0 + 120.0 + retry)
        assert restart_allowance(startup_timeout=300, liveness_timeout=60, resync=5) == 375.0
    finally:
        pool.close()


# ---------------------------------------------------------------- the launcher's count


def test_an_outage_ends_with_two_new_answers_or_another_instance(tmp_path: Path):
    endpoint = tmp_path / "vllm-0.json"
    count = AnswerCount(endpoint, "a")
    count.publish()
    assert read_answers(endpoint, "a") == 0 and read_answers(endpoint, "b") is None
    outage = Outage(endpoint, "a")
    count.add()
    assert not outage.over("a")
    count.add()
    assert outage.over("a")
    assert Outage(endpoint, "a").over("b"), "a restarted server is judged by its health alone"
    assert Outage(tmp_path / "foreign-0.json", "x").over("x"), "no count (a server we did not start): health decides"
    gone = Outage(endpoint, "a")
    count.remove()
    assert read_answers(endpoint, "a") is None
    assert not gone.over("a"), "a server whose count went is gone, not back: its successor is met anew"
