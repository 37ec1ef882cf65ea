"""`forge run` with the `code` reward on the built-in `code_basics` task, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

FORGE = [sys.executable, "-m", "forgerl.cli"]
SMALL = [
    "--model", "tiny",
    "--generator", "hf",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
]  # fmt: skip


def forge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, timeout=scaled(timeout))


def test_a_run_scores_completions_as_programs(tmp_path):
    out = tmp_path / "run"
    proc = forge(
        "run", "--task", "code_basics", "--reward", "code", *SMALL, "--steps", "2", "--output", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/code/pass_rate" in r]
    assert len(steps) == 2
    # The tiny random model writes no working program; what counts is that every sample
    # was run and scored, none failed.
    assert all(r["reward/failed"] == 0 for r in steps)
    assert all(0.0 <= r["reward/code/pass_rate"] <= 1.0 for r in steps)
    log = (out / "logs" / "trainer-0.log").read_text()
    assert "code reward: isolation '" in log, "the run log does not say which isolation is active"


def test_an_unavailable_isolation_level_stops_the_run_before_it_starts(tmp_path):
    if shutil.which("bwrap"):
        pytest.skip("bwrap is installed here")
    out = tmp_path / "run"
    proc = forge(
        "run", "--task", "code_basics", "--reward", "code", "--set", "rewards.0.options.isolation=bwrap",
        *SMALL, "--steps", "1", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "isolation 'bwrap' is not available" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out)
