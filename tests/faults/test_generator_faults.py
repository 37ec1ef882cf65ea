"""Faults of a generator server during a real run: `forge run` with the vllm generator.

A hung server (SIGSTOP: its process exists, nothing answers) must be handled like a
crashed one: its launcher sees ``/health`` go silent, kills it, the scheduler restarts the
replica, and the generator brings the new server to the current weights before it serves.
The run completes with no step lost or repeated. (A kill -9 of one of two replicas mid-run
is tests/integration/test_sglang_double.py::test_forge_run_end_to_end_survives_a_killed_replica.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hold_at_step import hold_env, marker, release
from tests.helpers.timing import scaled, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'forgerl[vllm]')"
    ),
]

SERVER_WAIT = 420.0  # start-up (and restart) of a vLLM server on a busy two-core machine
LIVENESS = 15  # seconds of silence after which the launcher kills its server


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_hung_generator_server_is_replaced_and_the_run_completes(tmp_path: Path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "forgerl.cli", "run",
        "--model", "tiny", "--generator", "vllm", "--trainer", "fsdp", "--steps", "3",
        "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
        "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
        "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
        "--set", "generator.options.replicas=1", "--set", "generator.options.kv_cache_gb=0.25",
        "--set", "generator.options.health_interval=0.5",
        "--set", f"generator.options.liveness_timeout={LIVENESS}",
        "--set", f"generator.options.startup_timeout={SERVER_WAIT}",
        "--set", "logging.progress=false",
        "--set", "trainer.options.autocast_bf16=false",  # fp32 like the sampler: the gap check
        "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=hold_env(1))
    stopped = None
    try:
        # Held after step 1 (weights version 1 served), before step 2: stop the only server.
        wait_until(lambda: marker(out, 1).exists() or proc.poll() is not None, 2 * SERVER_WAIT, "step 1 of the run")
        assert proc.poll() is None, f"the run ended at step 1: {proc.stderr.read()[-3000:]}"
        stopped = json.loads((out / "generators" / "vllm-0.json").read_text())["pid"]
        os.kill(stopped, signal.SIGSTOP)
        release(out, 1)
        _, stderr = proc.communicate(timeout=scaled(3 * SERVER_WAIT))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if stopped is not None and _state(stopped) == "T":
            os.kill(stopped, signal.SIGKILL)  # ours: never leave a stopped server behind
    assert proc.returncode == 0, stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3], "a step was lost or repeated"
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    gaps = [r["logprob_gap/mean"] for r in rows]
    assert max(gaps) < 1e-3, f"train/inference logprob gap per step (a stale replica served?): {gaps}"
    assert _state(stopped) == "gone", f"the hung server {stopped} is still there ({_state(stopped)})"
    launcher_log = (out / "logs" / "vllm-0.log").read_text()
    assert "killed as hung" in launcher_log, launcher_log[-2000:]
    events = (out / "logs" / "scheduler.log").read_text()
    assert "restarting vllm-0" in events, events[-2000:]
    trainer_log = "\n".join(p.read_text() for p in (out / "logs").glob("trainer*.log"))
    assert "brought to weights version" in trainer_log, trainer_log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
