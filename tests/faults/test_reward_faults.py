"""Rewards that hang, raise or crash, in a real `forge run`: the run trains its steps, the
failures are counted in the metrics, it exits 0, and no reward process outlives it.

Real runs as a user starts them: the tiny model, the hf generator, the fsdp trainer on one
gloo rank, the local scheduler. The misbehaving rewards other than `format` come from the
test-only plugin tests/helpers/fault_rewards.py, loaded by import path (FORGE_PLUGINS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.reward_processes import reward_workers_of
from ..helpers.timing import scaled

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--model", "tiny",
    "--generator", "hf",
    "--trainer", "fsdp",
    "--steps", "2",
    "--set", "loop.prompts_per_step=1",
    "--set", "loop.group_size=4",
    # Long enough that backtracking on a completion never finishes within the timeout.
    "--set", "loop.sampling.max_tokens=24",
    "--set", "loop.eval_at_start=false",
    "--set", "loop.eval_size=2",
    "--set", "loop.reward_timeout=2",
    "--set", "loop.failed_reward=-1",
]


def forge_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "FORGE_PLUGINS": "tests.helpers.fault_rewards",
    }
    return subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "run", *SMALL, *args, "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=scaled(300), cwd=REPO,
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_completed(out: Path, proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2], rows
    trainer_pids = [p["pid"] for p in json.loads((out / "job.json").read_text())["processes"]]
    leftovers = {pid: reward_workers_of(pid) for pid in trainer_pids if reward_workers_of(pid)}
    assert not leftovers, f"reward workers outlived the run: {leftovers}"
    return rows


def test_a_regex_backtracking_forever_is_timed_out_and_the_run_trains(tmp_path):
    # The regex holds the GIL: on a thread it froze the whole trainer (0 steps in 95 s).
    out = tmp_path / "run"
    proc = forge_run(
        out,
        "--reward", "format", "--set", "rewards.0.options.pattern=^(.+)+\\x00",
        "--reward", "format", "--set", "rewards.1.options.pattern=\\w",
    )
    rows = check_completed(out, proc)
    assert sum(r["reward/failed"] for r in rows) > 0, rows
    # A timed-out sample scores loop.failed_reward; the second, sane format reward still counts.
    assert all(-1.0 <= r["reward/format"] < 0 for r in rows), [r["reward/format"] for r in rows]
    assert all(r["reward/format_2"] > 0 for r in rows), [r["reward/format_2"] for r in rows]
    log = (out / "logs" / "trainer-0.log").read_text()
    assert "reward 'format' failed" in log and "timed out after 2s" in log, log[-3000:]


@pytest.mark.parametrize(
    "reward, reason",
    [("fault_raise", "RuntimeError: this reward always raises"), ("fault_exit", "its reward worker died")],
    ids=["raises-always", "exits-its-process"],
)
def test_a_reward_that_fails_on_every_sample_does_not_stop_the_run(tmp_path, reward, reason):
    out = tmp_path / "run"
    proc = forge_run(out, "--reward", reward, "--reward", "format", "--set", "rewards.1.options.pattern=\\w")
    rows = check_completed(out, proc)
    # Every sample failed (4 per step), was scored loop.failed_reward, and the run went on.
    assert [r["reward/failed"] for r in rows] == [4, 4], rows
    assert all(r[f"reward/{reward}"] == -1.0 for r in rows), rows
    assert all(r["reward/format"] > 0 for r in rows), rows
    assert reason in (out / "logs" / "trainer-0.log").read_text()
