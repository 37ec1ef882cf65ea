"""The sglang generator against real SGLang servers on CUDA GPUs. Skipped with a reason
where torch sees no CUDA device or the ``sglang`` package is not installed (every CPU
machine, CI included). Run on a GPU machine with SGLang installed (``pip install
'forgerl[sglang]'``, SGLang 0.5.23) with::

    pytest -q tests/gpu/test_sglang_cuda.py

What runs: the Generator kit (served logprobs against transformers in fp32, weight updates
over shm and over nccl, the new weights' logprobs after each), both update policies with
requests in flight, a killed replica replaced and re-synced, bf16 serving against the
trainer's logprobs, LoRA adapter versions loaded by name and sampled with, and a 3-step
``forge run --generator sglang``. The policy, failover and LoRA tests are the ones that
run against the SGLang test double on CPU (tests/integration/test_sglang_double.py,
test_sglang_lora.py), here with ``sglang.launch_server``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.testing import GeneratorContract
from forgerl_plugins.generators.sglang import SGLANG_VERSION

from ..helpers.timing import scaled
from ..integration.test_sglang_double import (  # noqa: F401 - collected here with this module's `cluster`
    test_a_killed_replica_fails_over_restarts_and_rejoins_at_the_current_weights,
    test_requests_in_flight_during_an_update,
)
from ..integration.test_sglang_lora import SETTINGS as LORA_SETTINGS
from ..integration.test_sglang_lora import (  # noqa: F401 - collected here with this module's `lora_site`
    test_each_adapter_version_is_loaded_by_name_and_sampled_with,
)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (SGLang has no CPU build)"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason=f"sglang is not installed (pip install 'forgerl[sglang]': sglang {SGLANG_VERSION})",
    ),
]

SERVER_WAIT_S = 600.0
#: Options of a small real server: fp32 kernels that take the tiny model's heads, seeded
#: sampling (the pytorch sampler honours sampling_seed), little memory per replica.
REAL = {
    "mem_fraction_static": 0.2,
    "dtype": "float32",
    "send_seed": True,
    "health_interval": 1.0,
    "startup_timeout": SERVER_WAIT_S,
    "server_args": {
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
    },
}
#: fp32 on the GPU against transformers fp32 on the GPU's kernels: rounding, not bf16.
FP32_ATOL = 1e-3


class TestSGLangOverShm(GeneratorContract):
    backend = "sglang"
    tiny_model_options = {"hidden_size": 128}
    options = {**REAL, "update_policy": "wait"}
    logprob_atol = FP32_ATOL


class TestSGLangOverNccl(GeneratorContract):
    backend = "sglang"
    tiny_model_options = {"hidden_size": 128}
    options = {**REAL, "update_policy": "abort"}
    settings = ("transport.name=nccl", "transport.options={}")
    logprob_atol = FP32_ATOL


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two real SGLang replicas behind the plugin's launcher (as the double's tests use)."""
    from forgerl.testing.generator_support import open_site, tiny_model

    model = tiny_model(tmp_path_factory.mktemp("model"), {"hidden_size": 128}, ())
    options = {**REAL, "replicas": 2, "max_restarts": 2}
    with open_site("sglang", options, (), model, tmp_path_factory.mktemp("run"), ()) as site:
        yield site


@pytest.fixture(scope="module")
def lora_site(tmp_path_factory):
    """A real SGLang replica started as a LoRA run starts it (the LoRA test of the double's)."""
    from forgerl.testing.generator_support import open_site, tiny_model

    model = tiny_model(tmp_path_factory.mktemp("model"), {"hidden_size": 128}, ())
    # SGLang's pure-torch LoRA kernels: the fp32 check needs no half-precision kernel.
    options = {**REAL, "server_args": {**REAL["server_args"], "lora_backend": "torch_native"}}
    with open_site("sglang", options, (), model, tmp_path_factory.mktemp("run"), LORA_SETTINGS) as site:
        yield site, FP32_ATOL


def test_bf16_served_logprobs_are_close_to_the_trainers(tmp_path_factory):
    """bf16 serving against the fp32 reference: per-token gaps of bf16 rounding (documented
    in docs/generators.md: mean below 0.02, none above 0.25 on the tiny model)."""
    import asyncio

    from forgerl.testing.generator_support import logprob_gap, open_site, tiny_model
    from forgerl.types import GenerationRequest, SamplingParams

    model = tiny_model(tmp_path_factory.mktemp("model"), {"hidden_size": 128}, ())
    options = {**REAL, "dtype": "bfloat16"}
    with (
        open_site("sglang", options, (), model, tmp_path_factory.mktemp("run"), ()) as site,
        site.open() as opened,
    ):
        requests = [
            GenerationRequest(f"b-{i}", site.random_prompt(i, 24), 2, SamplingParams(max_tokens=16))
            for i in range(4)
        ]
        results = asyncio.run(opened.generator.generate(requests))
        reference = site.reference()
        gaps = [
            logprob_gap(reference, r.prompt_token_ids, c, 1.0) for r, cs in zip(requests, results) for c in cs
        ]
    assert max(gaps) < 0.25, gaps


def test_forge_run_three_steps(tmp_path: Path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "forgerl.cli", "run",
        "--model", "tiny", "--generator", "sglang", "--trainer", "fsdp", "--steps", "3",
        "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
        "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
        "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
        "--set", "model.options.hidden_size=128",
        "--set", "generator.options.replicas=2", "--set", "generator.options.mem_fraction_static=0.2",
        "--set", "generator.options.dtype=float32",
        "--set", "trainer.options.autocast_bf16=false",  # fp32 on both sides: the gap check
        "--set", "generator.options.server_args={attention_backend: torch_native, disable_cuda_graph: true}",
        "--set", "logging.progress=false",
        "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=scaled(3 * SERVER_WAIT_S))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert max(r["logprob_gap/mean"] for r in rows) < 1e-2
