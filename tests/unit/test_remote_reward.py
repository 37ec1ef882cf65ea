"""The ``remote`` reward against a real HTTP server on 127.0.0.1, started by the test."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from forgerl.errors import ConfigError
from forgerl.registry.plugins import build_registry
from forgerl.rewards.rewarding import NamedReward, RewardSet
from forgerl.testing import RewardContract
from forgerl.types import Problem, RewardInput

from ..helpers.timing import scaled, wait_until

QUESTION = Problem(id="q", prompt="What is 2 + 2?", answer="4", metadata={"level": 1})


class ScoringService:
    """Scores 1.0 when the completion contains the answer, with a length component.
    ``fail_next`` answers 503 that many times first; ``hold`` makes requests wait."""

    def __init__(self):
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next = 0
        self.status: int | None = None  # every answer with this status, when set
        self.hold = threading.Event()
        self.hold.set()
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests.append(body)
                    service.headers.append(dict(self.headers))
                    service.in_flight += 1
                    service.peak = max(service.peak, service.in_flight)
                    failing = service.fail_next > 0
                    service.fail_next -= failing
                try:
                    service.hold.wait(scaled(30))
                    status = service.status or (503 if failing else 200)
                    answer = {
                        "score": float(body["answer"] in body["completion"]),
                        "components": {"chars": len(body["completion"]) % 97},
                    }
                    data = json.dumps(answer).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with service.lock:
                        service.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = ScoringService()
    yield s
    s.close()


def build(**options):
    return build_registry().require("reward", "remote").build(options)


def score(reward, sample):
    return asyncio.run(reward.ascore(sample))


class TestRemoteRewardKit(RewardContract):
    backend = "remote"

    @pytest.fixture(autouse=True)
    def _service(self, service):
        self.options = {"url": service.url, "backoff": 0}


def test_posts_the_sample_and_reads_score_and_components(service):
    result = score(build(url=service.url), RewardInput(QUESTION, "It is 4.", "length"))
    assert result.value == 1.0
    assert result.components == {"chars": 8.0}
    assert service.requests == [
        {
            "prompt": "What is 2 + 2?",
            "completion": "It is 4.",
            "answer": "4",
            "metadata": {"level": 1},
            "problem_id": "q",
            "finish_reason": "length",
        }
    ]


def test_retries_with_backoff_until_the_service_answers(service):
    service.fail_next = 2
    result = score(build(url=service.url, retries=2, backoff=0.01), RewardInput(QUESTION, "5"))
    assert result.value == 0.0
    assert len(service.requests) == 3


def test_a_sample_that_keeps_failing_is_a_failed_sample_and_the_run_goes_on(service):
    service.status = 500
    reward = build(url=service.url, retries=1, backoff=0)
    with RewardSet([NamedReward("remote", 1.0, reward)], failed_reward=-1.0) as rewards:
        (bad,) = rewards.score_sync([RewardInput(QUESTION, "4")])
        service.status = None
        (good,) = rewards.score_sync([RewardInput(QUESTION, "4")])
    assert bad.failed and bad.value == -1.0 and "HTTP 500" in bad.error
    assert len(service.requests) == 3  # the failed sample was tried twice
    assert not good.failed and good.value == 1.0


def test_an_unreachable_service_fails_the_sample(service):
    url = service.url
    service.close()
    with pytest.raises(Exception, match="failed 1 time"):
        score(build(url=url, retries=0), RewardInput(QUESTION, "4"))


def test_a_request_that_outlives_its_timeout_is_failed(service):
    service.hold.clear()
    with pytest.raises(Exception, match="timed out|TimeoutError"):
        score(build(url=service.url, timeout=0.2, retries=0), RewardInput(QUESTION, "4"))


def test_at_most_concurrency_requests_in_flight(service):
    service.hold.clear()
    reward = build(url=service.url, concurrency=2)

    async def many():
        tasks = [asyncio.ensure_future(reward.ascore(RewardInput(QUESTION, str(i)))) for i in range(6)]
        await asyncio.to_thread(wait_until, lambda: service.in_flight == 2, 10, "two requests in flight")
        service.hold.set()
        return await asyncio.gather(*tasks)

    assert len(asyncio.run(many())) == 6
    assert service.peak == 2


def test_the_token_comes_from_the_environment_and_is_never_in_messages(service, monkeypatch, caplog):
    monkeypatch.setenv("SCORER_TOKEN", "t0ps3cret")
    options = {"url": service.url, "auth_env": "SCORER_TOKEN", "retries": 0}
    score(build(**options), RewardInput(QUESTION, "4"))
    assert service.headers[-1]["Authorization"] == "Bearer t0ps3cret"
    service.status = 401
    caplog.set_level(logging.DEBUG)
    with RewardSet([NamedReward("remote", 1.0, build(**options))]) as rewards:
        (result,) = rewards.score_sync([RewardInput(QUESTION, "4")])
    assert result.failed and "401" in result.error
    assert "t0ps3cret" not in result.error and "t0ps3cret" not in caplog.text
    assert "t0ps3cret" not in json.dumps(options)  # what config.yaml would hold


def test_a_missing_token_variable_is_a_config_error(service, monkeypatch):
    monkeypatch.delenv("SCORER_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="SCORER_TOKEN"):
        build(url=service.url, auth_env="SCORER_TOKEN")


@pytest.mark.parametrize("answer", [{"score": "high"}, {"score": float("nan")}, {"value": 1}, [1]])
def test_an_answer_without_a_finite_score_fails_the_sample(answer):
    from forgerl_plugins.rewards.remote import RemoteReward

    reward = build(url="http://127.0.0.1:9/")
    with pytest.raises(Exception, match="remote reward"):
        RemoteReward._result(reward, answer)
