"""`forge run --trainer torchtitan` end to end, as a user runs it: the tiny model, the local
scheduler, real trainer ranks, the hf (and, where installed, vllm) generator fed the
weights the trainer exports over the shm and nccl transports, checkpoints and `--resume`
after SIGKILL."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hold_at_step import hold_env, marker
from tests.helpers.requires import require_torchtitan
from tests.helpers.timing import scaled, wait_until

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


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    common = [*SMALL, "--generator", "hf", "--steps", "4", "--set", "checkpoint.every=1",
              "--set", "loop.max_staleness=1", "--set", "loop.eval_every=2"]
    whole = tmp_path / "whole"
    proc = forge("run", *common, "--output", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]

    cut = tmp_path / "cut"
    front = subprocess.Popen([*FORGE, "run", *common, "--output", str(cut)], env=hold_env(2),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Held at step 2, once its checkpoint is saved: no race with a fast machine.
        wait_until(lambda: marker(cut, 2).exists(), 240, "the run to reach its second checkpoint", interval=0.2)
        for process in json.loads((cut / "job.json").read_text())["processes"]:
            os.kill(process["pid"], signal.SIGKILL)  # a crash, not a clean exit
        front.wait(timeout=scaled(60))
    finally:
        if front.poll() is None:
            front.kill()
    assert front.returncode != 0
    assert [r["step"] for r in metrics(cut)] == [1, 2]

    proc = forge("run", "--resume", str(cut))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(cut), metrics(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, reference):
        assert deterministic(a) == pytest.approx(deterministic(b), rel=1e-6, abs=1e-7), a["step"]


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
