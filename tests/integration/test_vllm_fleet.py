"""Several runs, one generator fleet: two runs' ``vllm`` generators attached to one real
vLLM CPU server (started as ``forge fleet`` starts
it), each loading versions of its own LoRA adapter through its own transport (``shm`` for
one, ``nccl`` (gloo on CPU) for the other).

What a user relies on: each run samples with its own adapter (the served logprobs equal
its trainer's, and are far from the other run's), one run's update never changes another
run's samples, and a run's end unloads its adapter while the fleet serves on.

One server for the module (``--max-loras 2``), started by the fleet's own command and
stopped by SIGTERM; the runs are cheap (no server of their own).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.timing import scaled, wait_until
from tests.helpers.weight_updates import send_while_loading

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed"),
]

ATOL = 1e-4  # served vs trainer logprobs, fp32 on both sides
RANK = 8
MAX_TOKENS = 10
SERVER_WAIT = 420.0
FLEET_OPTIONS = {
    "kv_cache_gb": 0.25,
    "health_interval": 0.5,
    "liveness_timeout": scaled(60),
    "startup_timeout": scaled(SERVER_WAIT),
}
RUN_OPTIONS = {"health_interval": 0.5, "startup_timeout": scaled(SERVER_WAIT)}
SETTINGS = [f"trainer.options.lora.rank={RANK}", "trainer.options.lora.alpha=16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forgerl.testing.generator_support import tiny_model

    # Heads 32 wide: vLLM's CPU attention has no kernels for narrower ones.
    return tiny_model(tmp_path_factory.mktemp("fleet-model"), {"hidden_size": 128})


@pytest.fixture(scope="module")
def fleet_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The fleet, started by its documented command; at the end stopped by SIGTERM, which
    must take its server down with it."""
    from forgerl_plugins.generators.common.replica import read_endpoint
    from forgerl_plugins.generators.vllm.server import endpoint_file

    directory = tmp_path_factory.mktemp("fleet")
    command = [sys.executable, "-m", "forgerl.cli", "fleet", "--dir", str(directory),
               "--model", str(model_dir), "--max-adapters", "2", "--max-rank", str(RANK)]  # fmt: skip
    for key, value in FLEET_OPTIONS.items():
        command += ["--set", f"generator.options.{key}={value}"]
    log = (directory.parent / "fleet-command.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: proc.poll() is not None or "forge fleet: ready" in (directory.parent / "fleet-command.log").read_text(),
            scaled(SERVER_WAIT), "the fleet command to say its server is up",
        )  # fmt: skip
        assert proc.poll() is None, (directory.parent / "fleet-command.log").read_text()
        endpoint = read_endpoint(endpoint_file(directory, 0))
        assert endpoint is not None and endpoint.get("pid")
        yield directory
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(scaled(120))
        log.close()
    assert rc == 0, (directory.parent / "fleet-command.log").read_text()
    # Its server went with it.
    wait_until(lambda: not _alive(int(endpoint["pid"])), scaled(60), "the fleet's server to stop")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def trainer(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One LoRA trainer whose adapter is set to each run's in turn (its references)."""
    from tests.helpers import trainer_worker as worker

    t = worker.make_trainer(model_dir, tmp_path_factory.mktemp("fleet-trainer"), 2, lora={"rank": RANK, "alpha": 16})
    yield t
    t.close()


def _run(model_dir: Path, fleet_dir: Path, run_dir: Path) -> Any:
    """A run attached to the fleet (it starts no server)."""
    from forgerl.testing.generator_support import open_site

    return open_site("vllm", {**RUN_OPTIONS, "fleet": str(fleet_dir)}, (), model_dir, run_dir, SETTINGS)


def _set_adapter(trainer: Any, seed: int) -> None:
    """An adapter large enough that sampling with it, without it or with another is told
    apart by orders of magnitude."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _push(opened: Any, trainer: Any, seed: int, version: int) -> None:
    """The trainer's half of an update: adapter ``seed`` sent as ``version`` while the run's
    generator loads it."""
    from forgerl.types import WeightSet

    _set_adapter(trainer, seed)
    exported = trainer.export_weights(version)
    assert exported is not None
    send_while_loading(
        opened.generator, opened.sender, WeightSet(version, dict(exported.tensors)), join_timeout=scaled(180)
    )


def _sample(opened: Any, site: Any, tag: str) -> list[tuple[list[int], Any]]:
    """Seeded samples of two prompts, one longer than two KV blocks (128 tokens each on
    vLLM's CPU build), so that reusing blocks cached under the adapter's previous version
    would show: ``(prompt, completion)`` pairs."""
    from forgerl.types import GenerationRequest, SamplingParams

    prompts = [site.chat_prompt("What is 2 + 3?"), site.random_prompt(seed=3, length=300)]
    requests = [
        GenerationRequest(f"{tag}-{i}", p, 2, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7 + i))
        for i, p in enumerate(prompts)
    ]
    results = asyncio.run(opened.generator.generate(requests))
    return [(list(r.prompt_token_ids), c) for r, cs in zip(requests, results) for c in cs]


def _gap(trainer: Any, seed: int, samples: list[tuple[list[int], Any]]) -> float:
    """The largest difference between the served logprobs and the trainer's with adapter ``seed``."""
    import torch

    _set_adapter(trainer, seed)
    worst = 0.0
    for prompt, completion in samples:
        tokens = list(completion.token_ids)
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        worst = max(worst, float((torch.tensor(completion.logprobs) - want).abs().max()))
    return worst


def _served_names(fleet_dir: Path) -> set[str]:
    """The model names the fleet's server serves (the base model and the registered adapters)."""
    import httpx

    from forgerl_plugins.generators.common.replica import read_endpoint, url_host
    from forgerl_plugins.generators.vllm.server import endpoint_file

    data = read_endpoint(endpoint_file(fleet_dir, 0))
    assert data is not None
    url = f"http://{url_host(data['host'])}:{data['port']}/v1/models"
    resp = httpx.get(url, headers={"Authorization": f"Bearer {data['api_key']}"}, timeout=60)
    resp.raise_for_status()
    return {m["id"] for m in resp.json()["data"]}


A1, B1, A2 = 11, 22, 33  # the adapters' seeds


def test_two_runs_sample_each_with_its_own_adapter(
    fleet_dir: Path, model_dir: Path, trainer: Any, tmp_path: Path
) -> None:
    with _run(model_dir, fleet_dir, tmp_path / "run-a") as site_a, _run(model_dir, fleet_dir, tmp_path / "run-b") as site_b:
        assert site_a.context().adapter is not None
        # Each run its own transport, of two kinds: the fleet's workers keep a receiver per run.
        with site_a.open("shm") as a, site_b.open("nccl") as b:
            assert type(b.transport).name == "nccl"
            name_a, name_b = a.generator.engine.adapter_name, b.generator.engine.adapter_name
            assert name_a != name_b
            # Neither run started a server: both talk to the fleet's one.
            assert a.generator.replica_info()[0]["url"] == b.generator.replica_info()[0]["url"]

            _push(a, trainer, A1, 1)
            _push(b, trainer, B1, 1)
            assert {name_a, name_b} <= _served_names(fleet_dir)
            a1, b1 = _sample(a, site_a, "a-v1"), _sample(b, site_b, "b-v1")
            assert all(c.policy_version == 1 for _, c in a1 + b1)
            assert _gap(trainer, A1, a1) < ATOL, "run A's samples are not from its adapter"
            assert _gap(trainer, B1, b1) < ATOL, "run B's samples are not from its adapter"
            # Those checks can fail: with the other run's adapter the logprobs are far off.
            assert _gap(trainer, B1, a1) > 100 * ATOL and _gap(trainer, A1, b1) > 100 * ATOL

            # Run A's update changes nothing of run B's samples.
            _push(a, trainer, A2, 2)
            a2, b1_again = _sample(a, site_a, "a-v2"), _sample(b, site_b, "b-v1-again")
            assert all(c.policy_version == 2 for _, c in a2)
            assert all(c.policy_version == 1 for _, c in b1_again)
            assert _gap(trainer, A2, a2) < ATOL, "run A's second version is not what it samples with"
            assert _gap(trainer, A1, a2) > 100 * ATOL, "run A still samples with its first version"
            assert _gap(trainer, B1, b1_again) < ATOL, "run A's update changed run B's samples"
            # Seeded: the same tokens as before A's update.
            assert [c.token_ids for _, c in b1_again] == [c.token_ids for _, c in b1]


def test_a_run_that_ends_unloads_its_adapter_and_the_fleet_serves_on(
    fleet_dir: Path, model_dir: Path, trainer: Any, tmp_path: Path
) -> None:
    with _run(model_dir, fleet_dir, tmp_path / "run-c") as site_c, _run(model_dir, fleet_dir, tmp_path / "run-d") as site_d:
        with site_d.open() as d:
            name_d = d.generator.engine.adapter_name
            with site_c.open() as c:
                name_c = c.generator.engine.adapter_name
                _push(c, trainer, A1, 1)
                _push(d, trainer, B1, 1)
                assert {name_c, name_d} <= _served_names(fleet_dir)
            # Run C ended: its adapter is gone from the server, run D's serves on.
            names = _served_names(fleet_dir)
            assert name_c not in names and name_d in names, names
            assert _gap(trainer, B1, _sample(d, site_d, "d-after")) < ATOL
