"""A `forge run` on a real Slurm survives preemption and requeue.

Each fault hits a real ``forge run --scheduler slurm --wait`` (tiny model, hf generator,
fsdp trainer, a checkpoint every step) while a step is in progress: the test holds that
step with the test-only reward tests/helpers/step_gate.py, so "mid-run" does not depend on
how fast steps are. Then:

* ``scontrol requeue JOB``: Slurm sends SIGTERM to every process of the job; the held step
  cannot finish within KillWait, so it is SIGKILLed and queued again. The next attempt
  (FORGE_REQUEUED=1) resumes in the same run directory from the last checkpoint; the step
  that was in progress is redone from it and its row appears once.
* ``scancel --signal=TERM JOB`` (a preemption notice: the steps are signalled, the batch
  script is not): the trainer finishes the step in progress, checkpoints it and exits 143;
  the batch script requeues the job itself; the next attempt resumes after that step, with
  nothing redone.

Both runs must end ``completed`` with steps 1..N in metrics.jsonl exactly once and the same
per-step metrics (deterministic keys) as a run that was never interrupted.

Needs a Slurm (scripts/slurm/start-local-slurm.sh); skipped with the reason when none
answers, a failure with FORGE_REQUIRE_SLURM=1 (as in CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..helpers import hold_at_step
from ..helpers.requires import slurm_unavailable
from ..helpers.timing import scaled, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forgerl.cli"]
STEPS = 5
RUN = [
    "--scheduler", "slurm",
    "--model", "tiny",
    "--generator", "hf",
    "--trainer", "fsdp",
    "--reward", "format",
    "--reward", "gate",
    "--set", "rewards.0.options.pattern=\\d",
    "--steps", str(STEPS),
    "--set", "checkpoint.every=1",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", "trainer.options.lr=1e-3",
    # A held sample must not time out: that would score it failed and change the metrics.
    "--set", "loop.reward_timeout=3600",
    "--set", "scheduler.options.requeue=true",
    "--set", "scheduler.options.poll_interval=0.5",
]


@pytest.fixture(scope="module", autouse=True)
def _slurm() -> None:
    why = slurm_unavailable()
    if why is not None:
        msg = f"no Slurm running here ({why}); start one with scripts/slurm/start-local-slurm.sh"
        if os.environ.get("FORGE_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def env(tmp: Path, gate: Path | None) -> dict[str, str]:
    """The submitting `forge run`'s environment; sbatch passes it on to the job."""
    out = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "FORGE_PLUGINS": "tests.helpers.step_gate,tests.helpers.hold_at_step",
        # The scheduler's job-id index: the test's, not the user's.
        "XDG_STATE_HOME": str(tmp / "state"),
    }
    out.pop("FORGE_TEST_GATE", None)
    out.pop("FORGE_TEST_HOLD_AT_STEP", None)
    if gate is not None:
        out["FORGE_TEST_GATE"] = str(gate)
        out["FORGE_TEST_HOLD_AT_STEP"] = "1"  # see Run.hold_a_step
    return out


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl as it is now (a resume may be rewriting it: skip a torn line)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def deterministic(row: dict) -> dict:
    """A metrics row without the wall-clock parts (as tests/integration/test_run_e2e.py)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def job_id_of(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "submission.json").read_text())["job_id"]
    except (OSError, ValueError, KeyError):
        return None


def batch_log(run_dir: Path, job_id: str) -> str:
    return read(run_dir / "logs" / f"slurm-{job_id}.out")


def resumed_at(run_dir: Path) -> list[int]:
    """The step each resumed attempt started from, from the trainer's log."""
    log = read(run_dir / "logs" / "trainer-0.log")
    return [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log)]


def slurm(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=scaled(60), check=False)
    assert proc.returncode == 0, (argv, proc.stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """Per-step metrics of the same run, never interrupted (the gate reward, never holding)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "run"
    proc = subprocess.run([*FORGE, "run", *RUN, "--output", str(out), "--wait"], capture_output=True, text=True,
                          env=env(tmp, None), cwd=REPO, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), got
    return got


class Run:
    """One `forge run --wait` in the background, with its gate and its Slurm job."""

    def __init__(self, tmp: Path):
        self.out, self.gate = tmp / "run", tmp / "gate"
        self.gate.mkdir()
        self.proc = subprocess.Popen([*FORGE, "run", *RUN, "--output", str(self.out), "--wait"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env(tmp, self.gate), cwd=REPO)
        self.job_id: str | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hold_a_step(self) -> int:
        """After step 1's row, hold the rollouts of the next step to be scored and wait
        until the trainer is inside the held step (see tests/helpers/step_gate.py);
        returns K, the steps finished and checkpointed: step K+1 is the one held."""
        # The run holds itself after step 1 (tests/helpers/hold_at_step.py) until the gate
        # is closed: on a fast machine the remaining steps would otherwise finish first.
        wait_until(lambda: hold_at_step.marker(self.out, 1).exists() or not self.alive(), 300, "step 1's end")
        assert self.alive(), self.proc.communicate()[1][-3000:]
        self.job_id = job_id_of(self.out)
        assert self.job_id, read(self.out / "submission.json")
        (self.gate / "hold").touch()
        hold_at_step.release(self.out, 1)

        def inside_held_step() -> bool:
            k = len(rows(self.out))
            return (self.gate / "held").exists() and (self.gate / f"published-{k}").exists()

        wait_until(lambda: inside_held_step() or not self.alive(), 120, "the trainer inside a held step")
        assert self.alive(), self.proc.communicate()[1][-3000:]
        done = len(rows(self.out))
        assert done < STEPS, f"the run ended before the hold took effect ({done} rows)"
        return done

    def release(self) -> None:
        (self.gate / "hold").unlink(missing_ok=True)

    def wait_second_attempt(self) -> None:
        assert self.job_id is not None
        wait_until(lambda: f"forge: job {self.job_id} attempt 1" in batch_log(self.out, self.job_id)
                   or not self.alive(), 180, "the requeued job's second attempt to start")
        assert self.alive(), self.proc.communicate()[1][-3000:]

    def finish(self) -> str:
        _, stderr = self.proc.communicate(timeout=scaled(400))
        assert self.proc.returncode == 0, stderr[-3000:]
        return stderr

    def close(self) -> None:
        self.release()
        if self.alive():
            self.proc.kill()
            self.proc.communicate()
        if self.job_id is not None:  # ours only; a no-op once the job has ended
            subprocess.run(["scancel", self.job_id], capture_output=True, check=False)


def check_whole_run(run: Run, reference: list[dict], stderr: str) -> None:
    got = rows(run.out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), [r["step"] for r in got]
    for mine, theirs in zip(got, reference):
        assert deterministic(mine) == pytest.approx(deterministic(theirs), rel=1e-6, abs=1e-7), mine["step"]
    assert all(r["reward/failed"] == 0 for r in got), [r["reward/failed"] for r in got]
    summary = json.loads((run.out / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["policy_version"]) == ("completed", STEPS, STEPS), summary
    assert "run completed" in stderr, stderr[-2000:]
    from forgerl_plugins.schedulers.slurm.scheduler import SlurmScheduler

    status = SlurmScheduler().status(run.job_id)
    assert status.state.value == "completed" and "restarted 1x" in status.detail, status


def test_scontrol_requeue_mid_step_resumes_from_the_checkpoint_and_redoes_that_step_once(reference, tmp_path):
    run = Run(tmp_path)
    try:
        done = run.hold_a_step()
        requeued_at = time.monotonic()
        slurm("scontrol", "requeue", run.job_id)
        # Hold until the first attempt is gone: the step in progress dies half done.
        run.wait_second_attempt()
        left = rows(run.out)
        summary_left = (run.out / "summary.json").exists()
        run.release()
        k = len(left)
        wait_until(lambda: len(rows(run.out)) > k or not run.alive(), 300, "the redone step's row")
        redone_s = time.monotonic() - requeued_at
        stderr = run.finish()
    finally:
        run.close()

    # What the killed attempt left: the finished steps; the held one died half done.
    assert [r["step"] for r in left] == list(range(1, done + 1)), (done, left)
    assert not summary_left, "the first attempt was to be killed mid-step, yet it ended by itself"
    # Same run directory, from the checkpoint of the last finished step: step k+1 redone.
    assert resumed_at(run.out) == [k], read(run.out / "logs" / "trainer-0.log")[-3000:]
    assert "DUE TO JOB REQUEUE" in batch_log(run.out, run.job_id)
    check_whole_run(run, reference, stderr)
    print(f"\nscontrol requeue during step {k + 1}: its row, redone by the requeued attempt, "
          f"{redone_s:.1f} s after the requeue")


def test_sigterm_notice_checkpoints_the_step_in_progress_and_the_job_requeues_itself(reference, tmp_path):
    run = Run(tmp_path)
    try:
        done = run.hold_a_step()
        signalled_at = time.monotonic()
        slurm("scancel", "--signal=TERM", run.job_id)
        wait_until(lambda: (run.gate / "sigterm").exists() or not run.alive(), 60,
                   "the SIGTERM to reach the job's processes")
        run.release()  # the trainer finishes the held step, checkpoints it, exits 143
        run.wait_second_attempt()
        requeued_s = time.monotonic() - signalled_at
        left = rows(run.out)
        summary_left = json.loads(read(run.out / "summary.json") or "{}")
        latest_left = read(run.out / "checkpoints" / "latest").strip()
        k = len(left)
        wait_until(lambda: len(rows(run.out)) > k or not run.alive(), 300, "the resumed attempt's first row")
        resumed_s = time.monotonic() - signalled_at
        stderr = run.finish()
    finally:
        run.close()

    # The step in progress at the signal was finished and checkpointed, not dropped.
    assert [r["step"] for r in left] == list(range(1, done + 2)), (done, left)
    assert latest_left == f"step-{k:06d}", latest_left
    assert (summary_left.get("status"), summary_left.get("steps")) == ("interrupted", k), summary_left
    assert resumed_at(run.out) == [k], read(run.out / "logs" / "trainer-0.log")[-3000:]
    log = batch_log(run.out, run.job_id)
    assert f"requeueing job {run.job_id}" in log, log
    check_whole_run(run, reference, stderr)
    print(f"\nscancel --signal=TERM during step {k}: step {k} checkpointed and the job requeued itself; "
          f"second attempt started {requeued_s:.1f} s and step {k + 1}'s row came {resumed_s:.1f} s after the signal")
