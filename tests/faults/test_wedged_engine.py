"""A wedged engine behind a live HTTP server.

The most common real hang on GPUs is a stuck NCCL or CUDA call: the engine core and its
workers stop, while the server's HTTP process goes on answering ``/health``. Before the fix
the launcher watched ``/health`` alone, so such a replica was never replaced; every request
sent to it waited for ``request_timeout`` and the run failed. Now the launcher's probe goes
through the engine, and a replica whose engine is silent for ``liveness_timeout`` is killed,
restarted by the scheduler and re-synced to the current weights like a crashed one.

Real servers: vLLM's CPU build (its engine-core process SIGSTOPped, the API server left
running), and the sglang generator against the SGLang double (its engine wedged through
the double's ``/double/wedge``: SGLang has no CPU build). A weight load longer than the
liveness timeout must not count as a hang: the generator tells the launcher it paused
the engine (generators/common/update_notice.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from forgerl_plugins.generators.common.replica import read_endpoint
from forgerl_plugins.serving import liveness
from forgerl_plugins.serving.launcher import healthy

from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

SERVER_WAIT = 420.0  # start-up (and restart) of a vLLM server on a busy two-core machine
#: Engine silence before the launcher kills its server: short, so that the test is quick;
#: scaled, so that a loaded machine's slow answers are not taken for a hang.
LIVENESS = 8.0
PLUGIN = "tests.helpers.sglang_double_plugin"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _replaced(gen, before: str) -> bool:
    info = gen.replica_info()[0]
    return info["instance"] != before and info["serving"]


def _requests(site, tag: str, count: int = 3):
    from forgerl.types import GenerationRequest, SamplingParams

    return [
        GenerationRequest(f"{tag}-{i}", site.random_prompt(i, 8), 1, SamplingParams(max_tokens=6, seed=i))
        for i in range(count)
    ]


def _assert_made_by(site, completions, version: int, weights) -> None:
    """Every completion says ``version`` and its logprobs are those of ``weights``."""
    from forgerl.testing.generator_support import logprob_gap

    flat = [(req, c) for req, cs in completions for c in cs]
    assert flat and all(c.policy_version == version for _, c in flat), [c.policy_version for _, c in flat]
    model = site.reference(weights)
    gaps = [logprob_gap(model, req.prompt_token_ids, c, 1.0) for req, c in flat]
    site.reference()
    assert max(gaps) < 1e-3, f"served logprobs are not version {version}'s weights: gaps {gaps}"


# ------------------------------------------------------------------------------ vLLM


@pytest.fixture(scope="module")
def vllm_site(tmp_path_factory):
    """One vLLM CPU replica of the tiny model, under the local scheduler as `forge run`
    starts it, with a short liveness timeout and restarts allowed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install 'forgerl[vllm]')")
    from forgerl.testing.generator_support import open_site, tiny_model
    from tests.helpers.shared_vllm import TINY_MODEL_OPTIONS

    model = tiny_model(tmp_path_factory.mktemp("model"), TINY_MODEL_OPTIONS)
    options = {
        "replicas": 1,
        "kv_cache_gb": 0.25,
        "health_interval": 0.5,
        "liveness_timeout": scaled(LIVENESS),
        "startup_timeout": scaled(SERVER_WAIT),
        "request_timeout": scaled(SERVER_WAIT),  # far longer than the liveness timeout
        "max_restarts": 2,
    }
    with open_site("vllm", options, (), model, tmp_path_factory.mktemp("run")) as site:
        yield site


def _push_held(opened, site, version: int, weights, hold: float) -> float:
    """``update_weights(version)`` with the send held back until the replica has been paused
    for ``hold`` seconds (its engine answers no probe meanwhile); how long it was paused."""
    from forgerl.types import WeightSet
    from forgerl_plugins.generators.common.update_notice import notice_file
    from forgerl_plugins.generators.vllm.server import endpoint_file

    notice = notice_file(endpoint_file(site.run_dir, 0))
    errors: list[BaseException] = []

    def update() -> None:
        try:
            opened.generator.update_weights(version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    loader = threading.Thread(target=update, daemon=True)
    loader.start()
    wait_until(notice.exists, 60, "the generator's notice that it pauses the replica")
    paused = time.monotonic()
    # The load waits for the trainer's bytes: here, a load as long as we like.
    wait_until(lambda: time.monotonic() - paused >= hold, hold + 60, f"a {hold:g} s weight load")
    opened.sender.send(WeightSet(version, dict(weights)), timeout=scaled(120))
    loader.join(scaled(180))
    assert not loader.is_alive() and not errors, f"update_weights({version}): {errors}"
    assert not notice.exists(), "the notice outlived the update"
    return time.monotonic() - paused


def test_a_weight_load_longer_than_the_liveness_timeout_is_not_a_hang(vllm_site):
    from forgerl_plugins.generators.vllm.server import endpoint_file

    site = vllm_site
    weights = site.new_weights(1)
    with site.open() as opened:
        gen = opened.generator
        before = read_endpoint(endpoint_file(site.run_dir, 0))
        assert before is not None
        paused = _push_held(opened, site, 1, weights, hold=scaled(LIVENESS) + 2 * liveness.PROBE_TIMEOUT)
        assert paused > scaled(LIVENESS)
        after = read_endpoint(endpoint_file(site.run_dir, 0))
        assert after is not None and after["instance"] == before["instance"], (
            f"the server was replaced during a {paused:.0f} s weight load"
        )
        assert gen.replica_info()[0]["version"] == 1
        _assert_made_by(site, _generate(gen, _requests(site, "long-load")), 1, weights)


def _generate(gen, requests):
    from forgerl.testing.generator_support import generate

    return list(zip(requests, generate(gen, requests, scaled(3 * SERVER_WAIT))))


def _through_the_replacement(site, gen, endpoint: Path, wedged_at: float):
    """Requests sent to a replica whose engine is wedged: they wait on it until its launcher
    kills it (its endpoint file goes), then go to the restarted server once it has the
    current weights; the caller sees no failure. Their results, and when each happened."""
    from forgerl.testing.generator_support import generate

    before = read_endpoint(endpoint)
    assert before is not None
    requests = _requests(site, "wedged")
    results: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.extend(zip(requests, generate(gen, requests, scaled(3 * SERVER_WAIT))))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    wait_until(lambda: not (endpoint.exists() and read_endpoint(endpoint) == before), LIVENESS + liveness.PROBE_TIMEOUT + 30,
               "the launcher to kill the server whose engine is wedged")  # fmt: skip
    killed = time.monotonic() - wedged_at
    wait_until(lambda: (e := read_endpoint(endpoint)) and e.get("instance") != before["instance"], SERVER_WAIT,
               "the restarted server")  # fmt: skip
    restarted = time.monotonic() - wedged_at
    wait_until(lambda: _replaced(gen, before["instance"]), SERVER_WAIT, "the restarted server in service")
    serving = time.monotonic() - wedged_at
    sender.join(scaled(3 * SERVER_WAIT))
    assert not sender.is_alive() and not errors, f"generate() across the replacement: {errors}"
    answered = time.monotonic() - wedged_at
    times = f"killed after {killed:.1f} s, restarted server up after {restarted:.1f} s, serving (re-synced) after {serving:.1f} s, requests answered after {answered:.1f} s"
    return results, times


def test_a_wedged_vllm_engine_is_replaced_and_resynced(vllm_site):
    from forgerl.testing.generator_support import push
    from forgerl_plugins.generators.vllm.server import endpoint_file, log_file

    site = vllm_site
    weights = site.new_weights(2)
    with site.open() as opened:
        gen = opened.generator
        push(opened, 2, weights, scaled(120))
        endpoint = read_endpoint(endpoint_file(site.run_dir, 0))
        assert endpoint is not None
        url = f"http://{endpoint['host']}:{endpoint['port']}"
        server = int(endpoint["pid"])
        engine = liveness.descendants(server)  # the engine core and its workers, not the API server
        assert engine, f"vLLM's API server {server} has no engine processes"
        stopped_at = time.monotonic()
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        try:
            # What made the hang invisible before: the API server still says it is healthy.
            assert healthy(url, scaled(10), endpoint["api_key"]), "vLLM's /health failed with only its engine stopped"
            results, times = _through_the_replacement(site, gen, endpoint_file(site.run_dir, 0), stopped_at)
        finally:
            for pid in engine:
                if _state(pid) == "T":
                    os.kill(pid, signal.SIGKILL)  # ours: never leave a stopped process behind
        assert all(_state(pid) in ("gone", "Z") for pid in [server, *engine]), "the wedged server was left running"
        log = log_file(site.run_dir, 0).read_text()
        assert "killed as hung" in log and "its engine" in log, log[-2000:]
        assert gen.replica_info()[0]["version"] == 2
        _assert_made_by(site, results, 2, weights)
        print(f"\nwedged vLLM engine (liveness_timeout {scaled(LIVENESS):g} s): {times}")


# ------------------------------------------------------------------ SGLang (double)


def test_a_wedged_sglang_engine_is_replaced_and_resynced(tmp_path: Path):
    from forgerl.testing.generator_support import open_site, push, tiny_model
    from forgerl_plugins.generators.sglang.server import endpoint_file, log_file
    from tests.helpers.sglang_double_plugin import DOUBLE_COMMAND

    options = {
        "replicas": 1,
        "launch_command": DOUBLE_COMMAND,
        "send_seed": True,
        "health_interval": 0.5,
        "liveness_timeout": scaled(LIVENESS),
        "startup_timeout": scaled(240),
        "request_timeout": scaled(240),
        "max_restarts": 2,
    }
    (tmp_path / "model").mkdir()
    model = tiny_model(tmp_path / "model", {}, ())
    with open_site("sglang_double", options, (PLUGIN,), model, tmp_path / "run") as site, site.open() as opened:
        gen = opened.generator
        weights = site.new_weights(3)
        push(opened, 3, weights, scaled(60))
        endpoint = read_endpoint(endpoint_file(site.run_dir, 0))
        assert endpoint is not None
        url = f"http://{endpoint['host']}:{endpoint['port']}"
        headers = {"Authorization": f"Bearer {endpoint['api_key']}"}
        import httpx

        wedged_at = time.monotonic()
        httpx.post(url + "/double/wedge", headers=headers, timeout=scaled(30)).raise_for_status()
        assert healthy(url, scaled(10), endpoint["api_key"]), "the double's /health failed with only its engine wedged"
        results, times = _through_the_replacement(site, gen, endpoint_file(site.run_dir, 0), wedged_at)
        log = log_file(site.run_dir, 0).read_text()
        assert "killed as hung" in log and "/health_generate" in log, log[-2000:]
        assert gen.replica_info()[0]["version"] == 3
        _assert_made_by(site, results, 3, weights)
        print(f"\nwedged SGLang (double) engine (liveness_timeout {scaled(LIVENESS):g} s): {times}")
