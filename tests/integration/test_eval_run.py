"""`forge eval` end to end, as a user runs it (real subprocesses, the tiny model, the hf
generator, the local scheduler): a run's last checkpoint evaluated by `forge eval RUN_DIR`
gives exactly the run's own held-out row (one code path: same requests, same seeds, same
rewards), with k samples per problem on top; an evaluation cut short resumes with
`forge eval --resume DIR` without redoing a finished sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
# Two regex rewards that the tiny random model meets sometimes: accuracy (the first) and the
# rewards vary from sample to sample, so equal rows are not equal by being all zero.
RUN = ["--model", "tiny", "--set", "trainer.options.autocast_bf16=false", "--set", "logging.tensorboard=false",
       "--generator", "hf", "--task", "arithmetic", "--reward", "format", "--reward", "format",
       "--set", r"rewards.0.options.pattern=\d", "--set", "rewards.1.options.pattern=E", "--set", "rewards.1.weight=0.5",
       "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2", "--set", "loop.sampling.max_tokens=8",
       "--set", "loop.eval_at_start=false", "--set", "loop.eval_size=6", "--set", "loop.eval_temperature=1.0"]  # fmt: skip


def forge(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORGE, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=scaled(300)
    )


def test_forge_eval_of_a_checkpoint_is_the_runs_own_evaluation_and_resumes(tmp_path: Path) -> None:
    env = {**os.environ, "FORGE_CACHE_DIR": str(tmp_path / "cache")}
    proc = forge("run", *RUN, "--steps", "1", "--output", "runs/rl", "-q", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/rl/metrics.jsonl").read_text().splitlines()]
    in_run = {key: value for key, value in rows[-1].items() if key.startswith("eval/")}
    assert rows[-1]["step"] == 1 and in_run["eval/samples"] == 6

    proc = forge(
        "eval", "runs/rl", "--k", "3", "--batch-size", "5", "--output", "runs/ev", "-q", cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the weights of its step 1" in proc.stderr and "mean@3" in proc.stderr, proc.stderr
    folder = tmp_path / "runs/ev"
    records = [json.loads(line) for line in (folder / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted((r["group"], r["index"]) for r in records) == [(g, j) for g in range(6) for j in range(3)]
    first = [r for r in records if r["index"] == 0]
    names = first[0]["components"].keys()
    assert set(names) == {"format", "format_2"}, names
    assert {
        "eval/accuracy": sum(r["correct"] for r in first) / 6,
        "eval/reward": pytest.approx(sum(r["reward"] for r in first) / 6, abs=1e-12),
        "eval/samples": 6,
        **{
            f"eval/reward/{n}": pytest.approx(sum(r["components"][n] for r in first) / 6, abs=1e-12)
            for n in names
        },
    } == in_run, "forge eval's sample 0 is not what the run's own evaluation drew"
    assert len({r["reward"] for r in records}) > 1, (
        "every sample scored the same: the comparison shows nothing"
    )
    summary = json.loads((folder / "eval_summary.json").read_text())
    assert (
        summary["k"] == 3
        and summary["problems"] == 6
        and set(summary["pass"]) == {"pass@1", "pass@2", "pass@3"}
    )
    assert summary["mean@3"]["mean"] == pytest.approx(sum(r["correct"] for r in records) / 18)

    # Cut short after 5 samples, the 6th line torn: the resumed evaluation keeps the five.
    lines = (folder / "eval_samples.jsonl").read_text().splitlines(keepends=True)
    (folder / "eval_samples.jsonl").write_text("".join(lines[:5]) + lines[5][:30])
    proc = forge("eval", "--resume", str(folder), "-q", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = (folder / "eval_samples.jsonl").read_text().splitlines(keepends=True)
    assert again[:5] == lines[:5] and len(again) == 5 + 1 + 13, "finished samples were redone"
    events = (folder / "events.jsonl").read_text()
    assert "5 samples already in eval_samples.jsonl, 13 to go" in events
    resumed = json.loads((folder / "eval_summary.json").read_text())
    assert resumed["samples"] == 18 and resumed["complete"]

    report = forge(
        "report", "runs/ev", "runs/ev", "--label", "a", "--label", "b", "-o", "r.html", cwd=tmp_path, env=env
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert "pass@3" in (tmp_path / "r.html").read_text()
