"""`forge run` with ``objective: distill`` and a teacher in the trainer's process, end to
end on the tiny model (hf generator, fsdp trainer, local scheduler): the student learns
from the teacher, and in an environment only the assistant's tokens are scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
BASE = [
    "run", "--model", "tiny", "--generator", "hf", "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
    "--set", "loop.prompts_per_step=4", "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=16",
    "--set", "loop.eval_size=4", "--set", "trainer.options.autocast_bf16=false", "--set", "objective=distill",
    "--quiet",
]
METRICS = {"distill/reverse_kl", "distill/agreement", "distill/scored_tokens", "distill/failed", "time/teacher"}


def forge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, env=dict(os.environ), timeout=scaled(300))


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uniform_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm zeroed: every next token equally likely. The
    reverse KL to it is log V - H(student), so a student that learns from it must spread
    out, whatever it sampled: a clear signal for a few steps of a tiny model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

    base = build_tiny_model(TinyModel.Options(), cache_dir=tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    folder = tmp_path_factory.mktemp("uniform-teacher")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def test_the_student_learns_from_an_in_process_teacher(tmp_path, uniform_teacher):
    out = tmp_path / "run"
    proc = forge(*BASE, "--steps", "4", "--output", str(out), "--set", f"distill.teacher.options.model={uniform_teacher}",
                 "--set", "trainer.options.lr=3e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert METRICS <= set(got[0]), METRICS - set(got[0])
    assert all(r["distill/failed"] == 0 and r["distill/scored_tokens"] > 0 for r in got), got
    # The advantage is minus the sampled reverse KL: at ratio 1 the step's loss is the KL itself.
    assert got[0]["loss/policy"] == pytest.approx(got[0]["distill/reverse_kl"], rel=1e-3, abs=1e-4)
    first, last = got[0]["distill/reverse_kl"], got[-1]["distill/reverse_kl"]
    assert last < first / 2, f"the reverse KL to the teacher did not fall: {[r['distill/reverse_kl'] for r in got]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert "objective: distill" in (out / "config.yaml").read_text()


def test_an_environment_trajectory_is_scored_on_the_assistants_tokens(tmp_path):
    out = tmp_path / "run"
    # The guess game answers every turn: trajectories with the environment's tokens between turns.
    proc = forge(*BASE, "--environment", "guess", "--steps", "2", "--output", str(out),
                 "--set", "environment.max_turns=3", "--set", "environment.max_total_tokens=96",
                 "--set", "distill.teacher.options.model=tiny",
                 "--set", "distill.teacher.options.model_options.seed=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in rows(out):
        samples = row["samples/trained"]
        sampled = row["env/sampled_tokens_mean"] * samples  # the assistant's tokens (mask 1)
        assert row["env/env_tokens_mean"] > 0, f"no environment tokens to leave out: {row}"
        assert row["distill/failed"] == 0, row
        assert row["distill/scored_tokens"] == pytest.approx(sampled), (
            "the teacher's signal covers exactly the assistant's tokens, never the environment's", row
        )
