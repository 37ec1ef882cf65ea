"""The served ``reward_model``, without vLLM: its role in the run's job, its options, and
its client against a stand-in ``/classify`` server on loopback (the real server:
tests/integration/test_reward_model_served.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from forgerl.errors import ConfigError, RewardError
from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput
from forgerl_plugins.rewards.reward_model import RewardModelReward
from forgerl_plugins.rewards.reward_server import endpoint_file, role_name
from tests.helpers.timing import scaled, wait_until

QUESTION = Problem(id="q", prompt=[{"role": "user", "content": "Say hi."}], answer="")


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model under a random 1-label classification head."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    )
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def _job(tmp_path: Path, rewards: list[dict[str, Any]]):
    from forgerl.configuration.config import build_config
    from forgerl.registry.resolve import resolve
    from forgerl.rundirs import runs

    registry = build_registry()
    config = resolve(
        build_config(flags={"model": "tiny", "generator": "hf"}, base={"rewards": rewards}), registry
    )
    return runs.build_job(config, registry, tmp_path)


def _served(model: str = "/models/rm", **more: Any) -> dict[str, Any]:
    return {"name": "reward_model", "options": {"model": model, "server": "vllm", **more}}


# ------------------------------------------------------------------ the run's job


def test_a_served_reward_model_adds_one_server_role_to_the_run(tmp_path):
    job = _job(tmp_path, [_served(), {"name": "format"}])
    [server] = [role for role in job.roles if not role.primary]
    assert server.name == role_name(RewardModelReward.Options(model="/models/rm", server="vllm"))
    assert server.command[-4:] == ("--run-dir", str(tmp_path), "--role", server.name)
    assert server.max_restarts == 3


def test_rewards_served_alike_share_one_server_and_others_get_their_own(tmp_path):
    same = _job(tmp_path, [_served(label=0), _served(activation="none")])
    assert [r.name for r in same.roles if not r.primary] == [
        role_name(RewardModelReward.Options(model="/models/rm"))
    ]
    apart = _job(tmp_path, [_served(), _served("/models/other")])
    assert len([r for r in apart.roles if not r.primary]) == 2


def test_in_process_and_url_scoring_start_no_server(tmp_path):
    rewards = [
        {"name": "reward_model", "options": {"model": "/models/rm"}},
        {"name": "reward_model", "options": {"model": "/models/rm", "url": "http://127.0.0.1:9"}},
    ]
    assert [r.name for r in _job(tmp_path, rewards).roles] == ["trainer"]


def test_url_and_a_run_server_together_are_refused():
    with pytest.raises(ValueError, match="either url"):
        RewardModelReward.Options(model="m", server="vllm", url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="auth_env is the key of the server at url"):
        RewardModelReward.Options(model="m", auth_env="KEY")


# ------------------------------------------------------------ a stand-in server


class StandIn:
    """A loopback ``/classify`` answering ``logits_of(ids)`` per input; records requests."""

    def __init__(self, logits_of, status: int = 200) -> None:
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((dict(self.headers), body))
                if self.path != "/classify" or status != 200:
                    self.send_response(status if status != 200 else 404)
                    self.end_headers()
                    self.wfile.write(b'{"error": "refused"}')
                    return
                data = [
                    {"index": i, "label": None, "probs": logits_of(ids), "num_classes": 1}
                    for i, ids in enumerate(body["input"])
                ]
                answer = json.dumps({"data": list(reversed(data))}).encode()  # any order
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn(lambda ids: [float(len(ids))])  # the "logit" is the token count
    yield server
    server.close()


def _build(options: dict[str, Any]):
    return build_registry().require("reward", "reward_model").build(options)


def _scores(reward, samples: list[RewardInput]) -> list[float]:
    from forgerl.rewards.rewarding import NamedReward, RewardSet

    with RewardSet([NamedReward("rm", 1.0, reward)], timeout=30) as rewards:
        results = rewards.score_sync(samples)
    assert not [r.error for r in results if r.failed]
    return [r.value for r in results]


def test_the_client_sends_the_samples_token_ids_and_reads_raw_logits(classifier_dir, stand_in, monkeypatch):
    monkeypatch.setenv("RM_KEY", "s3cret")
    url = f"http://127.0.0.1:{stand_in.port}/"
    reward = _build({"model": str(classifier_dir), "url": url, "auth_env": "RM_KEY", "max_length": 32})
    samples = [RewardInput(QUESTION, "hi"), RewardInput(QUESTION, "hi " * 40)]
    assert reward.model is None, "served: no model in this process"
    assert _scores(reward, samples) == [
        float(len(reward.tokenizer(reward.render(samples[0]))["input_ids"])),
        32.0,  # cut to max_length, keeping the end
    ]
    [(headers, body)] = stand_in.requests
    assert headers["Authorization"] == "Bearer s3cret"
    assert body["use_activation"] is False, "the reward applies its own activation"
    expected = reward.tokenizer([reward.render(s) for s in samples], truncation=True, max_length=32)[
        "input_ids"
    ]
    assert body["input"] == expected
    # Same ids as in-process scoring gives its model: the long text keeps its end.
    assert body["input"][1] == reward.tokenizer(reward.render(samples[1]))["input_ids"][-32:]


def test_the_key_variable_must_be_set(classifier_dir, monkeypatch):
    monkeypatch.delenv("RM_KEY", raising=False)
    with pytest.raises(ConfigError, match="'RM_KEY'"):
        _build({"model": str(classifier_dir), "url": "http://127.0.0.1:9", "auth_env": "RM_KEY"})


def test_a_refusing_or_absent_server_fails_the_samples_not_the_run(classifier_dir):
    from forgerl.rewards.rewarding import NamedReward, RewardSet

    refusing = StandIn(lambda ids: [0.0], status=503)
    try:
        for url in (f"http://127.0.0.1:{refusing.port}", "http://127.0.0.1:9"):
            reward = _build({"model": str(classifier_dir), "url": url})
            with RewardSet([NamedReward("rm", 1.0, reward)], timeout=30) as rewards:
                [result] = rewards.score_sync([RewardInput(QUESTION, "hi")])
            assert result.failed and "reward_model" in (result.error or ""), result
    finally:
        refusing.close()


# -------------------------------------------------------- the run's own server


def _publish(run_dir: Path, options: dict[str, Any], data: dict[str, Any]) -> None:
    path = endpoint_file(run_dir, role_name(RewardModelReward.Options.model_validate(options)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_run_server_is_found_through_its_endpoint_file(classifier_dir, stand_in, tmp_path, monkeypatch):
    options = {"model": str(classifier_dir), "server": "vllm", "startup_timeout": 30}
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    endpoint = {"host": "127.0.0.1", "port": stand_in.port, "api_key": "k1", "instance": "a", "model": "rm"}
    _publish(tmp_path, options, endpoint)
    reward = _build(options)
    assert _scores(reward, [RewardInput(QUESTION, "hi")])[0] > 0
    assert stand_in.requests[-1][0]["Authorization"] == "Bearer k1"
    assert stand_in.requests[-1][1]["model"] == "rm"
    # The server restarts on another port: the next request finds it there.
    moved = StandIn(lambda ids: [-1.0])
    try:
        _publish(tmp_path, options, {**endpoint, "port": moved.port, "api_key": "k2", "instance": "b"})
        stand_in.close()
        assert _scores(reward, [RewardInput(QUESTION, "hi")]) == [-1.0]
        assert moved.requests[-1][0]["Authorization"] == "Bearer k2"
    finally:
        moved.close()


class Counted:
    """Counts the client's looks at whether its server is back in service."""

    def __init__(self, client) -> None:
        self.looks = 0
        self.look = client.in_service
        client.in_service = self

    def __call__(self) -> bool:
        self.looks += 1
        return self.look()


def _score_one(reward, timeout: float) -> Any:
    from forgerl.rewards.rewarding import NamedReward, RewardSet

    with RewardSet([NamedReward("rm", 1.0, reward)], timeout=timeout) as rewards:
        [result] = rewards.score_sync([RewardInput(QUESTION, "hi")])
    return result


def test_samples_wait_for_a_restarting_run_server_beyond_their_timeout(classifier_dir, stand_in, tmp_path, monkeypatch):
    """The run's server dies: the sample in flight fails; the next one waits for the
    restarted server (the wait is not its reward_timeout's) and is scored by it."""
    options = {"model": str(classifier_dir), "server": "vllm", "startup_timeout": 30}
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    endpoint = {"host": "127.0.0.1", "port": stand_in.port, "api_key": "k1", "instance": "a", "model": "rm"}
    _publish(tmp_path, options, endpoint)
    reward = _build(options)
    stand_in.close()  # killed; no restarted server yet
    failed = _score_one(reward, timeout=30)
    assert failed.failed and "out of service" in (failed.error or ""), failed
    looks = Counted(reward.client.server)
    restarted = StandIn(lambda ids: [-1.0])
    waited: list[Any] = []
    scoring = threading.Thread(target=lambda: waited.append(_score_one(reward, timeout=0.2)), daemon=True)
    try:
        scoring.start()
        # Past the sample's 0.2 s timeout: three looks are 0.5 s apart at least.
        wait_until(lambda: looks.looks >= 3, scaled(30), "the sample waiting for the server")
        _publish(tmp_path, options, {**endpoint, "port": restarted.port, "api_key": "k2", "instance": "b"})
        scoring.join(scaled(30))
        assert not scoring.is_alive()
        [result] = waited
        assert not result.failed and result.value == -1.0, result
        assert restarted.requests[-1][0]["Authorization"] == "Bearer k2"
    finally:
        restarted.close()


def test_a_wedged_run_server_is_back_once_its_engine_answers_its_launcher(classifier_dir, tmp_path, monkeypatch):
    """The server answered HTTP 500: out of service until its launcher counted two more
    answers of its engine (the same instance, not restarted)."""
    from forgerl_plugins.serving.service import AnswerCount

    options = {"model": str(classifier_dir), "server": "vllm", "startup_timeout": 30}
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    role = role_name(RewardModelReward.Options.model_validate(options))
    count = AnswerCount(endpoint_file(tmp_path, role), "a")
    count.publish()
    failing = StandIn(lambda ids: [0.0], status=500)
    answering = StandIn(lambda ids: [2.0])
    try:
        endpoint = {"host": "127.0.0.1", "port": failing.port, "api_key": "k", "instance": "a", "model": "rm"}
        _publish(tmp_path, options, endpoint)
        reward = _build(options)
        failed = _score_one(reward, timeout=30)
        assert failed.failed and "HTTP 500" in (failed.error or "") and "out of service" in (failed.error or "")
        assert not reward.client.in_service()
        count.add()
        assert not reward.client.in_service(), "back on one answer, which may predate the failure"
        count.add()
        # The same server, answering again (the stand-in's port stands for its recovery).
        reward.client.server.url = f"http://127.0.0.1:{answering.port}"
        assert reward.client.in_service()
        assert _score_one(reward, timeout=30).value == 2.0
    finally:
        failing.close()
        answering.close()


def test_the_wait_for_the_run_server_ends_when_a_restart_would_have(classifier_dir, stand_in, tmp_path, monkeypatch):
    options = {"model": str(classifier_dir), "server": "vllm", "startup_timeout": 30}
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    _publish(tmp_path, options, {"host": "127.0.0.1", "port": stand_in.port, "api_key": "k", "instance": "a"})
    reward = _build(options)
    assert reward.client.server.allowance == 60.0 + 10.0 + 30.0  # liveness, one more probe, start-up
    reward.client.server.allowance = 0.3
    stand_in.close()
    assert _score_one(reward, timeout=30).failed
    result = _score_one(reward, timeout=30)
    assert result.failed and "has not served for 0.3 s (as long as a restart may take" in (result.error or ""), result


def test_a_server_that_failed_to_start_stops_the_wait_at_once(classifier_dir, tmp_path, monkeypatch):
    options = {"model": str(classifier_dir), "server": "vllm", "startup_timeout": 600}
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    _publish(tmp_path, options, {"error": "vLLM exited with status 1 before it was healthy"})
    with pytest.raises(RewardError, match="server failed: vLLM exited with status 1"):
        _build(options)


def test_no_server_in_time_is_an_error_naming_its_log(classifier_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_RUN_DIR", str(tmp_path))
    with pytest.raises(RewardError, match=r"not ready after 0.5 s \(log: .*logs/reward-model-"):
        _build({"model": str(classifier_dir), "server": "vllm", "startup_timeout": 0.5})


def test_a_run_server_outside_a_run_is_refused(classifier_dir, monkeypatch):
    monkeypatch.delenv("FORGE_RUN_DIR", raising=False)
    with pytest.raises(ConfigError, match="outside a run, give url"):
        _build({"model": str(classifier_dir), "server": "vllm"})


# ----------------------------------------------------------------- activations


@pytest.mark.parametrize(
    ("options", "logits", "want"),
    [
        ({}, [2.5], 2.5),
        ({"activation": "sigmoid"}, [0.0], 0.5),
        ({"activation": "sigmoid"}, [-1000.0], 0.0),  # no overflow
        ({"activation": "sigmoid"}, [1000.0], 1.0),
    ],
)
def test_one_label_values(classifier_dir, options, logits, want):
    reward = _build({"model": str(classifier_dir), "device": "cpu", **options})
    assert reward.value(logits) == pytest.approx(want)
    with pytest.raises(RewardError, match="2 logits for a model of 1 labels"):
        reward.value([0.0, 1.0])


def test_two_different_roles_of_one_name_are_refused():
    from forgerl.rundirs.runs import _add_role
    from forgerl.types import RoleSpec

    first = RoleSpec(name="reward-model-x", command=("a",))
    assert _add_role([first], RoleSpec(name="reward-model-x", command=("a",)), "rewards.1") == [first]
    with pytest.raises(ConfigError, match="rewards.1 needs a server role named 'reward-model-x'"):
        _add_role([first], RoleSpec(name="reward-model-x", command=("b",)), "rewards.1")
