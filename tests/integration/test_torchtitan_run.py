"""`forge run --trainer torchtitan` end to end, as a user runs it: the tiny model, the local
scheduler, real trainer ranks, the hf (and, where installed, vllm) generator fed the
weights the trainer exports over the shm and nccl transports. (`--resume` after SIGKILL:
test_run_e2e, parametrized by trainer.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.requires import require_torchtitan
from tests.helpers.timing import scaled

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
# As in test_run_e2e: a format reward that random text sometimes satisfies, so the tiny
# model's groups have reward variance and the runs really train.
SMALL = [
    "--model", "tiny", "--trainer", "torchtitan",
    "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
    "--set", "trainer.options.lr=1e-3", "--set", "logging.progress=false",
    "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
    # fp32 on every CPU (the default bf16 autocast on native-bf16 hardware would put the
    # trainer a few percent from the sampler): the gap checks below compare fp32 to fp32.
    "--set", "trainer.options.autocast_bf16=false",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_torchtitan()


def forge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, timeout=scaled(timeout))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


@pytest.mark.parametrize(("ranks", "transport"), [(1, "shm"), (2, "nccl")])
def test_three_steps_with_the_hf_generator(tmp_path: Path, ranks: int, transport: str) -> None:
    out = tmp_path / "run"
    proc = forge("run", *SMALL, "--generator", "hf", "--transport", transport, "--steps", "3",
                 "--set", f"trainer.ranks={ranks}", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["policy_version"] for r in rows] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in rows), "nothing was learned from: no reward variance"
    # The generator samples with the weights the trainer exported under Hugging Face
    # names: the same policy on both sides, so the logprobs agree.
    assert max(r["logprob_gap/max"] for r in rows) < 1e-4, [r["logprob_gap/max"] for r in rows]
    assert len(list((out / "logs").glob("trainer*"))) == ranks
    first = sorted((out / "logs").glob("trainer*"))[0]
    assert f"trainer torchtitan on {ranks} rank(s)" in first.read_text()
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def test_a_model_it_cannot_express_stops_the_run_with_exit_2(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "gelu-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    proc = forge("run", "--model", str(folder), "--trainer", "torchtitan", "--generator", "hf", "--steps", "1",
                 "--output", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot express the model" in proc.stderr and "hidden_act 'gelu'" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')")
def test_three_steps_with_the_vllm_generator(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = forge("run", *SMALL, "--generator", "vllm", "--steps", "3", "--set", "generator.options.kv_cache_gb=0.25",
                 "--output", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    gaps = [r["logprob_gap/mean"] for r in rows]
    assert max(gaps) < 1e-3, f"train/inference logprob gap per step: {gaps}"
