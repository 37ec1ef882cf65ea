"""A trainer rank killed with SIGKILL on 2 gloo ranks, in a real `forge run`.

The run must fail fast (the local scheduler notices the dead rank; rank 0's next
collective gets "connection reset" instead of waiting for gloo's timeout), with one line
naming the rank, and ``forge run --resume`` must end with the same per-step metrics as a
run that was never interrupted (as tests/integration/test_run_e2e.py compares them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..helpers.hold_at_step import hold_env, marker, release
from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forgerl.cli"]
RUN = [
    "--model", "tiny",
    "--generator", "hf",
    "--trainer", "fsdp",
    "--reward", "format",
    "--set", "rewards.0.options.pattern=\\d",
    "--set", "trainer.ranks=2",
    "--steps", "4",
    "--set", "checkpoint.every=1",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", "trainer.options.lr=1e-3",
    # A stopped role gets stop_timeout before SIGKILL: a run that hangs on gloo instead of
    # failing takes at least that long, far past FAIL_FAST_S even when both are scaled.
    "--set", "scheduler.options.stop_timeout=1000",
]
#: Failing fast (the other rank's gloo call errors, the job ends) takes a few seconds idle;
#: the margin is for a loaded machine (20 s was once not enough at load 10), and anything
#: below stop_timeout tells "failed" from "hung until killed".
FAIL_FAST_S = 120


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def test_sigkill_of_a_trainer_rank_fails_fast_naming_it_and_resume_matches(tmp_path: Path):
    whole = tmp_path / "whole"
    proc = subprocess.run([*FORGE, "run", *RUN, "--output", str(whole)], capture_output=True, text=True,
                          cwd=REPO, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]

    cut = tmp_path / "cut"
    front = subprocess.Popen([*FORGE, "run", *RUN, "--output", str(cut)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=hold_env(2))
    try:
        # Held at step 2 once its checkpoint is saved (no race with a fast machine); rank 0
        # goes on into step 3 once rank 1 is dead.
        wait_until(lambda: marker(cut, 2).exists(), 300, "the run's second checkpoint")
        job = json.loads((cut / "job.json").read_text())
        rank1 = next(p["pid"] for p in job["processes"] if p["role"] == "trainer" and p["rank"] == 1)
        killed_at = time.monotonic()
        os.kill(rank1, 9)
        release(cut, 2)
        wait_until(lambda: front.poll() is not None, FAIL_FAST_S, "forge run to fail after its rank 1 died")
        took = time.monotonic() - killed_at
        stderr = front.stderr.read()
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
    print(f"kill -9 of rank 1 -> forge run exited after {took:.2f} s")
    assert front.returncode == 137, stderr[-3000:]
    named = [line for line in stderr.splitlines() if "rank 1" in line]
    assert named and "SIGKILL" in named[0], stderr[-3000:]
    assert [r["step"] for r in metrics(cut)] == [1, 2]

    proc = subprocess.run([*FORGE, "run", "--resume", str(cut)], capture_output=True, text=True, cwd=REPO,
                          timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = metrics(cut), metrics(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, reference):
        assert deterministic(a) == pytest.approx(deterministic(b), rel=1e-6, abs=1e-7), a["step"]
