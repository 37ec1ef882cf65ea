"""The torchtitan trainer on a GPU: parity with fsdp on CUDA, and a 2-step run with NCCL.
Skipped where torch sees no CUDA device (every CPU machine, CI included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: CUDA's fp32 kernels (SDPA's memory-efficient kernel in transformers, the math one in
#: TorchTitan's fp32 path) round differently from each other more than CPU kernels do.
TOL = 1e-4


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_torchtitan()


def test_same_logprobs_and_update_as_fsdp_on_cuda(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = worker.make_batch(tiny_model_dir, rows=4, seed=3)
    trainers = {}
    try:
        for kind in ("torchtitan", "fsdp"):
            trainers[kind] = worker.make_trainer(tiny_model_dir, tmp_path, 2, kind=kind, backend="nccl")
            assert trainers[kind].device.type == "cuda", trainers[kind].device
        logprobs = {kind: t.logprobs(batch) for kind, t in trainers.items()}
        stepped = worker.on_policy(trainers["fsdp"], batch)
        metrics = {kind: t.train_step(stepped) for kind, t in trainers.items()}
        weights = {kind: worker.weights(t, 1) for kind, t in trainers.items()}
    finally:
        for trainer in reversed(trainers.values()):
            trainer.close()
    attended = batch.attention_mask[:, 1:] != 0
    diff = (logprobs["torchtitan"][:, 1:] - logprobs["fsdp"][:, 1:]).abs()[attended].max().item()
    assert diff <= TOL, f"logprobs differ by {diff} on CUDA"
    assert metrics["torchtitan"]["loss"] == pytest.approx(metrics["fsdp"]["loss"], rel=1e-5, abs=1e-6)
    worst = max((weights["torchtitan"][k] - weights["fsdp"][k]).abs().max().item() for k in weights["fsdp"])
    assert worst <= TOL, f"after one step the weights differ by {worst} on CUDA"


def test_two_steps_with_nccl(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", "--model", "tiny", "--trainer", "torchtitan",
         "--generator", "hf", "--steps", "2", "--set", "trainer.options.backend=nccl",
         "--set", "trainer.options.autocast_bf16=false",  # fp32 on both sides: the gap check
         "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=12",
         "--set", "loop.eval_size=4", "--set", "logging.progress=false", "--output", str(out)],
        capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert max(r["logprob_gap/max"] for r in rows) < 1e-2
