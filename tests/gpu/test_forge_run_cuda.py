"""A whole ``forge run`` on a CUDA GPU with the defaults a GPU user gets: the trainer and
the hf generator on the GPU, bf16 autocast where the GPU computes bf16 natively (``auto``),
the importance ratio then against the trainer's own logprobs, weights over shm. Skipped
where torch sees no CUDA device (every CPU machine, CI included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.helpers.requires import require_torchtitan  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("trainer", ["fsdp", "torchtitan"])
def test_the_default_run_trains_on_the_gpu(trainer: str, tmp_path: Path) -> None:
    if trainer == "torchtitan":
        require_torchtitan()
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", "--model", "tiny", "--trainer", trainer,
         "--generator", "hf", "--steps", "3", "--set", "loop.prompts_per_step=2",
         "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=12",
         "--set", "loop.eval_size=4", "--set", "logging.progress=false", "--output", str(out)],
        capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    logs = "\n".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))
    native = torch.cuda.get_device_capability(0) >= (8, 0)
    # "auto" follows the hardware: bf16 on Ampere and later, and then the ratio is taken
    # against the trainer's own logprobs (docs/algorithms.md).
    want = "bf16 autocast on cuda:0; importance ratio against the trainer's own" if native else "float32 on cuda:0"
    assert want in logs, logs[-3000:]
    for r in rows:
        assert all(v == v for k, v in r.items() if isinstance(v, float)), r  # no NaN anywhere
