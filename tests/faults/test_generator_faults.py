"""Faults of a generator server during a real run: `forge run` with the vllm generator.

A hung server (SIGSTOP: its process exists, nothing answers) must be handled like a
crashed one: its launcher sees ``/health`` go silent, kills it, the scheduler restarts the
replica, and the generator brings the new server to the current weights before it serves.
The run completes with no step lost or repeated. (A kill -9 of one of two replicas mid-run
is tests/integration/test_sglang_double.py::test_forge_run_end_to_end_survives_a_killed_replica.)

A wedged engine behind the only server (its API server still answers ``/health``) with a
request timeout shorter than the liveness timeout: the request that timed out waits for
the replacement instead of being retried into the wedged engine until its attempts are
spent (the run used to fail while the new server was starting).
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

from forgerl_plugins.serving import liveness
from tests.helpers.hold_at_step import hold_env, marker, problems_waiting, release
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


def _command(out: Path, *options: str) -> list[str]:
    """`forge run` of 3 steps on one vLLM replica, with more generator ``options``."""
    return [
        sys.executable, "-m", "forgerl.cli", "run",
        "--model", "tiny", "--generator", "vllm", "--trainer", "fsdp", "--steps", "3",
        "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
        "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4",
        "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
        "--set", "generator.options.replicas=1", "--set", "generator.options.kv_cache_gb=0.25",
        "--set", "generator.options.health_interval=0.5",
        "--set", f"generator.options.startup_timeout={SERVER_WAIT}",
        *(part for option in options for part in ("--set", f"generator.options.{option}")),
        "--set", "logging.progress=false",
        "--set", "trainer.options.autocast_bf16=false",  # fp32 like the sampler: the gap check
        "--output", str(out),
    ]  # fmt: skip


def _through_step_1(out: Path, command: list[str], stop, gate: Path | None = None) -> tuple[str, list[int]]:
    """Run ``command``, held after step 1 (weights version 1 served) while ``stop(endpoint)``
    stops processes of the only server (their pids: SIGKILLed at the end if still stopped);
    the run's stderr. With ``gate`` (the ``held_arithmetic`` task's file, which exists), the
    rollouts of step 2 wait for the stop too: their requests are the first to meet it."""
    env = hold_env(1)
    if gate is not None:
        env["FORGE_TEST_HOLD_PROBLEMS"] = str(gate)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    stopped: list[int] = []
    try:
        wait_until(lambda: marker(out, 1).exists() or proc.poll() is not None, 2 * SERVER_WAIT, "step 1 of the run")
        assert proc.poll() is None, f"the run ended at step 1: {proc.stderr.read()[-3000:]}"
        if gate is not None:
            wait_until(lambda: problems_waiting(gate).exists(), scaled(60), "step 2's rollouts to wait")
        stopped += stop(json.loads((out / "generators" / "vllm-0.json").read_text()))
        if gate is not None:
            gate.unlink()
        release(out, 1)
        _, stderr = proc.communicate(timeout=scaled(3 * SERVER_WAIT))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in stopped:
            if _state(pid) == "T":
                os.kill(pid, signal.SIGKILL)  # ours: never leave a stopped process behind
    assert proc.returncode == 0, stderr[-3000:]
    return stderr, stopped


def _completed_once_each_through_a_replacement(out: Path) -> None:
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3], "a step was lost or repeated"
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    gaps = [r["logprob_gap/mean"] for r in rows]
    assert max(gaps) < 1e-3, f"train/inference logprob gap per step (a stale replica served?): {gaps}"
    launcher_log = (out / "logs" / "vllm-0.log").read_text()
    assert "killed as hung" in launcher_log, launcher_log[-2000:]
    events = (out / "logs" / "scheduler.log").read_text()
    assert "restarting vllm-0" in events, events[-2000:]
    trainer_log = "\n".join(p.read_text() for p in (out / "logs").glob("trainer*.log"))
    assert "brought to weights version" in trainer_log, trainer_log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_a_hung_generator_server_is_replaced_and_the_run_completes(tmp_path: Path):
    out = tmp_path / "run"

    def stop(endpoint: dict) -> list[int]:
        os.kill(endpoint["pid"], signal.SIGSTOP)  # the API server itself: /health goes silent
        return [endpoint["pid"]]

    _, [stopped] = _through_step_1(out, _command(out, f"liveness_timeout={LIVENESS}"), stop)
    _completed_once_each_through_a_replacement(out)
    assert _state(stopped) == "gone", f"the hung server {stopped} is still there ({_state(stopped)})"


#: Part of the scenario, not a deadline: three of these fit before the default liveness
#: timeout (60 s) has the wedged server killed, as in the run that failed; the tiny model's
#: requests take well under a second.
REQUEST_TIMEOUT = 15.0


def test_a_wedged_engine_behind_the_only_server_does_not_end_the_run(tmp_path: Path):
    """The engine core and its workers stopped, the API server left answering /health (a
    stuck NCCL or CUDA call), the default liveness timeout: step 2's requests (the first to
    meet the stopped engine) time out, then wait for the launcher to kill the server and
    for the restarted one, re-synced, to answer them. Before, each was sent twice more into
    the wedged engine and the run failed ("failed on every vLLM replica (3 attempts)")
    before the new server was up."""
    out = tmp_path / "run"
    gate = tmp_path / "hold-problems"
    gate.touch()

    def stop(endpoint: dict) -> list[int]:
        engine = liveness.descendants(int(endpoint["pid"]))  # not the API server
        assert engine, f"vLLM's API server {endpoint['pid']} has no engine processes"
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        return engine

    command = [*_command(out, f"request_timeout={REQUEST_TIMEOUT:g}"), "--task", "held_arithmetic"]
    stderr, stopped = _through_step_1(out, command, stop, gate)
    _completed_once_each_through_a_replacement(out)
    assert all(_state(pid) in ("gone", "Z") for pid in stopped), "the wedged engine was left running"
    trainer_log = "\n".join(p.read_text() for p in (out / "logs").glob("trainer*.log"))
    assert "failed on replica 0 (ReadTimeout" in trainer_log, "no request timed out on the wedged engine"
    assert "failed on every" not in trainer_log + stderr
