"""The ``reward_model`` reward served by a real vLLM pooling server (CPU build, tiny model).

One server serves the whole module (its start is the expensive part, 30-60 s here): the
run's job is built as ``forge run`` builds it (:func:`forgerl.rundirs.runs.build_job`), and the
local scheduler starts its reward-model role; the test process plays the trainer. The
same samples are scored in-process (transformers) and through the server, and must agree.

The classifier is the built-in tiny Qwen2 (32-wide heads, which vLLM's CPU attention
needs) under a random 3-label head scaled so that its logits are of order 1 and differ
between samples. Both sides run fp32.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from forgerl.types import Problem, RewardInput
from tests.helpers.timing import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"
    ),
]

#: Served vs in-process scores. fp32 on both sides; measured differences are ~1e-7 (the
#: kernels differ, the inputs do not), so 1e-4 leaves room and still catches a different
#: text, truncation or token (those move the scores by 1e-2 and more).
ATOL = 1e-4
SERVER_WAIT = 420.0  # start-up of a vLLM server on a busy two-core machine
MAX_LENGTH = 48  # small, so that long samples are cut (from the left) on both sides

QUESTION = Problem(id="q", prompt=[{"role": "user", "content": "What is 17 + 25?"}], answer="42")
PLAIN = Problem(id="p", prompt="Say hi.", answer="")
SAMPLES = [
    RewardInput(QUESTION, "The answer is <answer>42</answer>."),
    RewardInput(QUESTION, "The answer is <answer>32</answer>."),
    RewardInput(QUESTION, "I think it is 42"),
    RewardInput(QUESTION, ""),
    RewardInput(PLAIN, "hi"),
    RewardInput(PLAIN, "Hello there, what is the question?"),
    RewardInput(QUESTION, "step first " * 40 + "so the answer is 42"),  # longer than MAX_LENGTH
]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    base = build_tiny_model(TinyModel.Options(), cache_dir=tmp_path_factory.mktemp("models"))
    config = AutoConfig.from_pretrained(base, num_labels=3)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # the default init gives logits of ~1e-2
    folder = tmp_path_factory.mktemp("classifier")
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def _options(classifier_dir: Path, **more: object) -> dict[str, object]:
    return {
        "model": str(classifier_dir),
        "dtype": "float32",
        "max_length": MAX_LENGTH,
        "device": "cpu",
        **more,
    }


@pytest.fixture(scope="module")
def run(classifier_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The run's reward-model server, started by the local scheduler from the run's job."""
    from forgerl.configuration.config import build_config
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve
    from forgerl.rundirs import runs
    from forgerl.types import JobSpec
    from forgerl_plugins.schedulers.local.scheduler import LocalScheduler

    run_dir = tmp_path_factory.mktemp("rm-run")
    registry = build_registry()
    served = _options(classifier_dir, server="vllm", startup_timeout=scaled(SERVER_WAIT))
    rewards = [{"name": "reward_model", "options": served}]
    config = resolve(build_config(flags={"model": "tiny", "generator": "hf"}, base={"rewards": rewards}), registry)
    runs.write_config(run_dir, config)
    job = runs.build_job(config, registry, run_dir)
    servers = tuple(role for role in job.roles if not role.primary)
    assert [role.name for role in servers] == [_role(served)], (
        "the run's job has the reward-model server role"
    )
    scheduler = LocalScheduler(LocalScheduler.Options(stop_timeout=10))
    started = threading.Event()

    def supervise() -> None:
        # The scheduler's children die with the thread that started them: submit and
        # supervise in the same thread, for the whole module.
        handle = scheduler.submit(JobSpec("rm-test", str(run_dir), servers))
        started.set()
        scheduler.wait(handle)

    thread = threading.Thread(target=supervise, name="rm-test-scheduler", daemon=True)
    thread.start()
    started.wait(scaled(30))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORGE_RUN_DIR", str(run_dir))  # every process of a run has it
        try:
            yield run_dir, config.dump()["rewards"][0]["options"]  # as config.yaml holds them
        finally:
            scheduler.cancel(str(run_dir))
            thread.join(scaled(60))


def _role(options: dict[str, object]) -> str:
    from forgerl_plugins.rewards.reward_model import RewardModelReward
    from forgerl_plugins.rewards.reward_server import role_name

    return role_name(RewardModelReward.Options.model_validate(options))


def _build(options: dict[str, object]):
    from forgerl.registry.plugins import build_registry

    return build_registry().require("reward", "reward_model").build(options)


def _score(reward, samples=SAMPLES) -> list[float]:
    from forgerl.rewards.rewarding import NamedReward, RewardSet

    with RewardSet([NamedReward("rm", 1.0, reward)], timeout=scaled(60)) as rewards:
        results = rewards.score_sync(samples)
    assert all(not r.failed for r in results), [r.error for r in results]
    return [r.value for r in results]


def _endpoint(run_dir: Path, options: dict[str, object]) -> dict[str, object]:
    from forgerl_plugins.rewards.reward_server import endpoint_file

    return json.loads(endpoint_file(run_dir, _role(options)).read_text())


def test_served_and_in_process_scores_agree(run, classifier_dir):
    run_dir, served_options = run
    served = _build(served_options)  # waits for the server
    assert served.model is None and served.client is not None, "scored through the server, no local model"
    local = _build(_options(classifier_dir))
    for activation in ("auto", "none"):  # label 2's probability, then its raw logit
        served.options = served.options.model_copy(update={"activation": activation})
        local.options = local.options.model_copy(update={"activation": activation})
        through_server, in_process = _score(served), _score(local)
        assert through_server == pytest.approx(in_process, abs=ATOL), activation
        assert len({round(v, 3) for v in in_process}) > 3, "the samples score differently"
    # The long sample was cut to its last MAX_LENGTH tokens on both sides (vLLM would
    # refuse a longer input: its context is MAX_LENGTH).
    assert len(local.tokenizer(local.render(SAMPLES[-1]))["input_ids"]) > MAX_LENGTH
    assert _endpoint(run_dir, served_options)["num_labels"] == 3


def test_a_server_given_by_url_scores_alike(run, classifier_dir, monkeypatch):
    run_dir, served_options = run
    _build(served_options)  # the server is ready
    endpoint = _endpoint(run_dir, served_options)
    monkeypatch.setenv("RM_TEST_KEY", str(endpoint["api_key"]))
    url = f"http://{endpoint['host']}:{endpoint['port']}"
    by_url = _build(_options(classifier_dir, url=url, auth_env="RM_TEST_KEY"))
    local = _build(_options(classifier_dir))
    assert _score(by_url, SAMPLES[:3]) == pytest.approx(_score(local, SAMPLES[:3]), abs=ATOL)


def test_every_path_of_the_server_needs_the_run_key(run):
    run_dir, served_options = run
    _build(served_options)
    endpoint = _endpoint(run_dir, served_options)
    body = json.dumps({"input": [[1, 2, 3]], "use_activation": False}).encode()
    request = urllib.request.Request(
        f"http://{endpoint['host']}:{endpoint['port']}/classify",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=scaled(30))
    assert refused.value.code == 401


def test_a_sample_the_server_fails_fails_alone(run):
    """An input vLLM refuses (no tokens at all) fails its samples; the run goes on."""
    from forgerl.rewards.rewarding import NamedReward, RewardSet

    _, served_options = run
    served = _build({**served_options, "chat_template": False})
    empty = RewardInput(Problem(id="e", prompt="", answer=""), "")
    with RewardSet([NamedReward("rm", 1.0, served)], timeout=scaled(60)) as rewards:
        [failed] = rewards.score_sync([empty])
        [fine] = rewards.score_sync(SAMPLES[:1])
    assert failed.failed and "reward_model" in (failed.error or "")
    assert not fine.failed
