"""`forge sft` end to end, as a user runs it (real subprocesses, the tiny model, the local
scheduler): a trainer-only run; one killed and resumed that matches an uninterrupted one
(data position, RNG with LoRA dropout, optimizer); the task's demonstrations with held-out
accuracy through the generator; SFT then RL by naming the first run as the second's model;
the job of every scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.hold_at_step import kill_run_held_at
from ..helpers.timing import scaled
from ..unit.test_sft_render import calculator_demo

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
TINY = ["--model", "tiny", "--set", "trainer.options.autocast_bf16=false", "--set", "logging.tensorboard=false"]
ROWS = [
    calculator_demo(),
    {"messages": [{"role": "user", "content": "What is 3 + 4?"},
                  {"role": "assistant", "content": "3 + 4 = 7, so the answer is <answer>7</answer>."}]},
    {"prompt": "What is 2 + 2?", "completion": " 4"},
    {"text": "the sum of the number is correct"},
    {"prompt": [{"role": "user", "content": "What is 12 - 5?"}], "completion": "so the answer is <answer>7</answer>"},
]  # fmt: skip


def forge(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, env=env or dict(os.environ), cwd=cwd,
                          timeout=scaled(timeout))  # fmt: skip


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


@pytest.fixture
def demos(tmp_path: Path) -> Path:
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_a_tiny_sft_run_trains_without_a_generator(tmp_path: Path, demos: Path) -> None:
    out = tmp_path / "run"
    proc = forge("sft", "--data", str(demos), *TINY, "--steps", "4", "--output", str(out),
                 "--set", "sft.batch_size=2", "--set", "trainer.options.lr=1e-3")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {"loss", "loss/sft", "grad_norm", "sft/epoch", "sft/tokens", "throughput/train_tokens_per_s"} <= set(rows[0])
    assert [r["sft/epoch"] for r in rows] == [0.4, 0.8, 1.2, 1.6]  # 5 demonstrations, 2 a step
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["objective"] == "sft"
    assert summary["demonstrations"] == {"kept": 5} and summary["eval_accuracy_end"] is None
    job = json.loads((out / "job.json").read_text())
    assert [p["role"] for p in job["processes"]] == ["trainer"], "a run that does not evaluate starts no generator"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert "loss " in proc.stderr, "progress shows the loss of a supervised run"
    report = forge("report", str(out))
    assert report.returncode == 0, report.stderr[-2000:]
    assert "loss/sft" in (out / "report.html").read_text(), "forge report plots the supervised loss"


def test_a_killed_lora_sft_run_resumes_as_if_never_stopped(tmp_path: Path, demos: Path) -> None:
    pytest.importorskip("peft")
    # LoRA dropout draws from the RNG each step; the data order is shuffled per epoch.
    common = ["sft", "--data", str(demos), *TINY, "--steps", "5", "--set", "sft.batch_size=2",
              "--set", "checkpoint.every=1", "--set", "trainer.options.lr=1e-2",
              "--set", "trainer.options.lora.rank=4", "--set", "trainer.options.lora.dropout=0.2"]  # fmt: skip
    whole = tmp_path / "whole"
    proc = forge(*common, "--output", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]

    cut = tmp_path / "cut"
    front = kill_run_held_at([*FORGE, *common, "--output", str(cut)], cut, 3)
    assert front.returncode != 0 and [r["step"] for r in rows_of(cut)] == [1, 2, 3]

    proc = forge("sft", "--resume", str(cut))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = rows_of(cut), rows_of(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert len({r["loss"] for r in reference}) == 5, "every step trains on other examples"
    for a, b in zip(resumed, reference):
        assert deterministic(a) == pytest.approx(deterministic(b), rel=1e-6, abs=1e-7), a["step"]


@pytest.mark.parametrize("source", ["task demonstrations", "calculator conversations"])
def test_held_out_accuracy_through_the_generator(tmp_path: Path, demos: Path, source: str) -> None:
    """The task's worked answers evaluated on its held-out problems (one completion each),
    or tool conversations evaluated through the calculator environment's trajectories."""
    out = tmp_path / "run"
    data = [] if source == "task demonstrations" else ["--data", str(demos), "--environment", "calculator",
                                                       "--set", "environment.max_total_tokens=64"]  # fmt: skip
    proc = forge("sft", "--task", "arithmetic", *data, *TINY, "--generator", "hf", "--steps", "2", "--output",
                 str(out), "--set", "sft.batch_size=4", "--set", "loop.eval_size=4",
                 "--set", "loop.sampling.max_tokens=8", "--set", "trainer.options.lr=1e-3")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2] and "eval/accuracy" in rows[-1] and "eval/accuracy" not in rows[0]
    assert rows[-1]["eval/samples"] == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_start"] is not None and summary["eval_accuracy_end"] is not None
    assert summary["policy_version"] == 2, "the generator evaluated the weights of the last step"
    assert summary["demonstrations"]["kept"] == (8 if source == "task demonstrations" else len(ROWS))


def test_sft_then_rl_by_naming_the_run(tmp_path: Path, demos: Path, tiny_model_dir: Path) -> None:
    """`forge sft --output runs/sft`, then `forge run --model run:sft`: the RL run starts from
    the SFT run's last checkpoint (what `forge export` writes of it), recorded in its config."""
    import torch
    from safetensors.torch import load_file

    env = {**os.environ, "FORGE_CACHE_DIR": str(tmp_path / "cache")}
    proc = forge("sft", "--data", str(demos), *TINY, "--steps", "2", "--output", "runs/sft",
                 "--set", "trainer.options.lr=1e-2", env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = forge("run", *TINY, "--model", "run:sft", "--generator", "hf", "--steps", "1", "--output", "runs/rl",
                 "--reward", "format", "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2",
                 "--set", "loop.sampling.max_tokens=8", "--set", "loop.eval_at_start=false",
                 "--set", "loop.eval_size=2", env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = tmp_path / "runs" / "sft" / "checkpoints" / "step-000002"
    assert f"forge: model run:sft: the weights of its step 2 ({checkpoint})" in proc.stderr
    config = (tmp_path / "runs" / "rl" / "config.yaml").read_text()
    assert f"name: {checkpoint}" in config, "the RL run records the checkpoint it started from"
    assert json.loads((tmp_path / "runs" / "rl" / "summary.json").read_text())["status"] == "completed"
    rl = rows_of(tmp_path / "runs" / "rl")
    assert rl[0]["logprob_gap/max"] < 1e-3, "trainer and generator loaded the same weights"

    # Its samples as SFT data (rejection-sampling fine-tuning, docs/sft.md). The tiny random model
    # never ends a turn within 8 tokens: no whole text to train on, said in one line.
    from dataclasses import replace

    from transformers import AutoTokenizer

    from forgerl.samples import read_samples
    from forgerl.sft.from_samples import sft_rows, write_rows
    from forgerl.sft.render import Renderer
    from forgerl.sft.rows import parse_row

    proc = forge("samples", "runs/rl", "--export", "rft.jsonl", cwd=tmp_path)
    assert proc.returncode == 2 and "stopped at the token limit" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "rft.jsonl").exists()
    # Had they ended: each recorded prompt (the chat template already applied, decoded from the
    # generator's ids) renders back to exactly as many tokens as the generator was given.
    records = [replace(r, finish_reason="stop", completion=" the end")
               for r in read_samples(tmp_path / "runs" / "rl") if r.kind == "train"]
    made = sft_rows(records)
    assert len(made.rows) == len({r.problem_id for r in records}) > 0, made.summary()  # a group's texts once
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=100_000)
    given = {r.problem_id: r.prompt_tokens for r in records}
    for row in made.rows:
        assert row["prompt"].count("<|im_start|>user") == 1, row["prompt"]
        example = renderer.render(parse_row(row, "rft.jsonl")).example
        assert example is not None and example.loss_mask.index(1) == given[row["problem_id"]], row["prompt"]
    write_rows(made.rows, str(tmp_path / "rft.jsonl"))
    proc = forge("sft", "--data", "rft.jsonl", *TINY, "--steps", "1", "--output", "runs/rft", "--dry-run",
                 env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]

    exported = forge("export", "runs/sft", "--output", "exported", env=env, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    (folder,) = (tmp_path / "cache" / "runs").glob("sft-step-000002-*")
    used, expected = load_file(folder / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert used.keys() == expected.keys()
    assert all(torch.equal(used[k], expected[k]) for k in used), "the RL run's model is not the SFT run's weights"
    assert not all(torch.equal(used[k], base[k]) for k in base), "the SFT run's weights are the base model's"


def test_a_run_named_as_a_model_must_have_a_checkpoint(tmp_path: Path, demos: Path) -> None:
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    (tmp_path / "runs" / "empty" / "config.yaml").write_text("model:\n  name: tiny\n")
    proc = forge("run", "--model", "run:empty", "--steps", "1", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("forge: error: model 'run:empty' is a run without a checkpoint yet (one is written "
                                   "every checkpoint.every steps and at the end); wait for one, or name a model")
    proc = forge("run", "--model", "run:nothing", "--steps", "1", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "no run 'nothing'" in proc.stderr, proc.stderr
