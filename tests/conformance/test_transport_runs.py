"""`forge run` end to end over the nccl, rdma and delta transports: the tiny model, the fsdp
trainer, and either generator: hf in the trainer's process (its receiver talks to the
sender through the transport like any other) or a real vLLM server (a receiver in its
worker). The served logprobs must equal the trainer's after every update, which only
holds if each version arrived bit-exact."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.requires import require_mooncake
from ..helpers.timing import scaled

# A vLLM server's start-up on a busy two-core machine takes minutes.
pytestmark = [pytest.mark.integration, pytest.mark.hard_timeout(900)]

FORGE = [sys.executable, "-m", "forgerl.cli"]
SMALL = [
    "--model", "tiny",
    "--trainer", "fsdp",
    "--steps", "2",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", f"transport.timeout={scaled(60)}",
    "--set", "logging.progress=false",
    # fp32 on every CPU (the default bf16 autocast on native-bf16 hardware would put the
    # trainer a few percent from the sampler): the gap checks below compare fp32 to fp32.
    "--set", "trainer.options.autocast_bf16=false",
]  # fmt: skip
VLLM = ["--set", "generator.options.kv_cache_gb=0.25"]
NO_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"
)


@pytest.mark.parametrize(
    ("generator", "transport", "ranks"),
    [
        # Two trainer ranks: the transport's private group must not disturb FSDP's default group.
        ("hf", "nccl", 2),
        ("hf", "rdma", 1),
        # Deltas against each receiver's base over one authenticated TCP port.
        ("hf", "delta", 1),
        # The receivers live inside vLLM's workers (the plugin's worker extension builds them).
        pytest.param("vllm", "nccl", 2, marks=[pytest.mark.vllm, NO_VLLM]),
        pytest.param("vllm", "rdma", 1, marks=[pytest.mark.vllm, NO_VLLM]),
    ],
)
def test_forge_run_over_transport(tmp_path: Path, generator: str, transport: str, ranks: int) -> None:
    if transport == "rdma":
        require_mooncake()
    out = tmp_path / "run"
    command = [*FORGE, "run", *SMALL, "--generator", generator, "--transport", transport,
               "--set", f"trainer.ranks={ranks}", "--output", str(out)]  # fmt: skip
    if generator == "vllm":
        command += VLLM
    proc = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=scaled(840), env={**os.environ}
    )
    logs = sorted((out / "logs").glob("*.log")) if (out / "logs").exists() else []
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(
        f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in logs
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob_gap/mean"] < 1e-3, r
        assert r["logprob_gap/max"] < 1e-3, r
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    if transport == "delta":
        # The generator loaded the same folder: version 1 went as a delta against its files
        # (whole, it would be at least the fp32 file's size: the same tensors, in fp32).
        log = (out / "logs" / "trainer-0.log").read_text()
        assert "new receivers start from the model's files" in log, log[-2000:]
        folder = Path(log.split("model ", 1)[1].split(";", 1)[0])
        whole = (folder / "model.safetensors").stat().st_size
        took = re.search(r"version 1 came as (\d+) bytes against the model's files", log)
        assert took is not None and int(took.group(1)) < whole, (took, whole, log[-2000:])
