"""`forge run` end to end over the nccl and rdma transports: the tiny model, the hf
generator in the trainer's process (its receiver talks to the sender through the
transport like any other), the fsdp trainer. The served logprobs must equal the
trainer's after every update, which only holds if each version arrived bit-exact."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
SMALL = [
    "--model", "tiny",
    "--generator", "hf",
    "--steps", "2",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", "transport.timeout=60",
]  # fmt: skip


@pytest.mark.parametrize(
    ("transport", "ranks"),
    [
        # Two trainer ranks: the transport's private group must not disturb FSDP's default group.
        ("nccl", 2),
        ("rdma", 1),
    ],
)
def test_forge_run_over_transport(tmp_path: Path, transport: str, ranks: int) -> None:
    if transport == "rdma" and importlib.util.find_spec("mooncake") is None:
        pytest.skip("rdma needs Mooncake: pip install 'forgerl[rdma]'")
    out = tmp_path / "run"
    proc = subprocess.run(
        [*FORGE, "run", *SMALL, "--transport", transport, "--set", f"trainer.ranks={ranks}", "--output", str(out)],
        check=False, capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    log = out / "logs" / "trainer-0.log"
    assert proc.returncode == 0, proc.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob_gap/mean"] < 1e-3, r
        assert r["logprob_gap/max"] < 1e-3, r
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
