"""The slurm scheduler against a real Slurm (scripts/slurm/start-local-slurm.sh starts one
on this machine). Skipped, with the reason, when no Slurm answers; FORGE_REQUIRE_SLURM=1
(as in CI) turns that skip into a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgerl.errors import ForgeError, JobNotFound, UserError
from forgerl.types import JobSpec, JobState, Resources, RoleSpec
from forgerl_plugins.schedulers.slurm.scheduler import SbatchRejected, SlurmScheduler
from tests.helpers.requires import slurm_unavailable
from tests.helpers.timing import scaled, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

PY = sys.executable


@pytest.fixture(scope="module")
def slurm() -> SlurmScheduler:
    why = slurm_unavailable()
    if why is not None:
        msg = f"no Slurm running here ({why}); start one with scripts/slurm/start-local-slurm.sh"
        if os.environ.get("FORGE_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return SlurmScheduler(SlurmScheduler.Options(poll_interval=0.5, stop_timeout=10))


@pytest.fixture(autouse=True)
def _own_job_index(tmp_path, monkeypatch):
    # The scheduler remembers job id -> run directory under $XDG_STATE_HOME; keep the
    # tests' entries out of the user's.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _job(run_dir: Path, *roles: RoleSpec, name: str = "forge-test") -> JobSpec:
    return JobSpec(name=name, run_dir=str(run_dir), roles=roles)


def _wait_for(predicate, timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what, interval=0.3)  # some predicates start a process


def _cancel_quietly(slurm: SlurmScheduler, job_id: str) -> None:
    try:
        slurm.cancel(job_id)
    except ForgeError:  # the test's own assertion is what matters
        pass


def test_primary_completes_and_ends_the_sidecar(slurm, run_dir):
    code = (
        "import os, pathlib; e = os.environ; "
        "pathlib.Path(e['FORGE_RUN_DIR'], 'primary.txt').write_text("
        "f\"{e['FORGE_ROLE']} {e['FORGE_REPLICA']} {e['RANK']} {e['WORLD_SIZE']} {e['GREETING']}\"); "
        "print('primary done', flush=True)"
    )
    job = _job(
        run_dir,
        RoleSpec(name="server", command=("sleep", "600"), resources=Resources(cpus=1)),
        RoleSpec(name="trainer", command=(PY, "-c", code), primary=True, env={"GREETING": "hello there"}),
    )
    start = time.monotonic()
    handle = slurm.submit(job)
    try:
        status = slurm.wait(handle, timeout=scaled(90))
    finally:
        _cancel_quietly(slurm, handle.job_id)
    took = time.monotonic() - start

    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status
    # The sidecar would sleep 600 s: the job ended because the primary did.
    assert took < scaled(60), f"job took {took:.0f}s: the sidecar was not stopped when the primary ended"
    assert (run_dir / "primary.txt").read_text() == "trainer 0 0 1 hello there"
    assert (run_dir / "slurm" / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert (run_dir / "slurm" / "job_id").read_text().strip() == handle.job_id
    assert (run_dir / "logs" / "server-0.log").exists()
    assert list(slurm.logs(handle.job_id, role="trainer")) == ["primary done"]
    everything = list(slurm.logs(handle.job_id))
    assert "[trainer-0] primary done" in everything, everything
    assert any(line.startswith("[scheduler] forge: job ") for line in everything), everything
    assert any(line.startswith("forge: job ") for line in slurm.logs(handle.job_id, role="scheduler"))
    assert slurm.status(handle.job_id).state is JobState.COMPLETED
    # Once slurmctld forgets the job (MinJobAge), status falls back to the completion log.
    assert slurm._sacct(handle.job_id) == ("COMPLETED", "0:0")


def test_failing_primary_fails_the_job_with_its_status(slurm, run_dir):
    job = _job(
        run_dir,
        RoleSpec(name="server", command=("sleep", "600")),
        RoleSpec(name="trainer", command=(PY, "-c", "import sys; print('boom'); sys.exit(3)"), primary=True),
    )
    handle = slurm.submit(job)
    try:
        status = slurm.wait(handle, timeout=scaled(90))
    finally:
        _cancel_quietly(slurm, handle.job_id)
    assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    lines = list(slurm.logs(handle.job_id, role="trainer"))
    # The role's output and srun's own report of the failure, in either order: srun gets
    # the task's output and its exit over separate connections and prints each as it comes
    # (a loaded machine showed the report first).
    assert lines.count("boom") == 1, lines
    assert any("exit code 3" in line for line in lines if line != "boom"), lines


def test_cancel_a_running_job(slurm, run_dir):
    started = run_dir / "started"
    job = _job(
        run_dir,
        RoleSpec(name="trainer", primary=True,
                 command=("bash", "-c", f"touch {started}; exec sleep 600")),
    )
    handle = slurm.submit(job)
    try:
        _wait_for(started.exists, 60, "the job to start")
        assert slurm.status(handle.job_id).state is JobState.RUNNING
        slurm.cancel(handle.job_id)
        status = slurm.wait(handle, timeout=scaled(60))
    finally:
        _cancel_quietly(slurm, handle.job_id)
    assert status.state is JobState.CANCELLED, status
    slurm.cancel(handle.job_id)  # cancelling a finished job is a no-op, not an error


def test_requeued_job_runs_again_with_forge_requeued(slurm, run_dir):
    # First attempt records FORGE_REQUEUED and waits to be requeued; the second one
    # (FORGE_REQUEUED=1, as a resuming trainer would see it) finishes.
    code = (
        "import os, pathlib, time; n = os.environ['FORGE_REQUEUED']; "
        "f = pathlib.Path(os.environ['FORGE_RUN_DIR'], 'attempts'); "
        "f.open('a').write(n + '\\n'); "
        "n == '0' and time.sleep(600)"
    )
    attempts = run_dir / "attempts"
    scheduler = SlurmScheduler(SlurmScheduler.Options(poll_interval=0.5, requeue=True))
    handle = scheduler.submit(_job(run_dir, RoleSpec(name="trainer", command=(PY, "-c", code), primary=True)))
    try:
        _wait_for(attempts.exists, 60, "the first attempt to start")
        proc = subprocess.run(["scontrol", "requeue", handle.job_id], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        # Slurm holds a requeued job for AuthInfo cred_expire seconds (10 in our config).
        status = scheduler.wait(handle, timeout=scaled(150))
    finally:
        _cancel_quietly(scheduler, handle.job_id)
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status
    assert attempts.read_text().split() == ["0", "1"]
    assert "restarted 1x" in scheduler.status(handle.job_id).detail
    assert "#SBATCH --requeue" in (run_dir / "slurm" / "job.sbatch").read_text()


@pytest.mark.slow  # two torch imports: 10-30 s on two busy cores
def test_two_ranks_rendezvous_with_torch_distributed(slurm, run_dir):
    code = (
        "import os, torch, torch.distributed as dist; dist.init_process_group('gloo'); "
        "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); "
        "print('rank', dist.get_rank(), 'of', dist.get_world_size(), 'sum', int(t.item()), "
        "'port', os.environ['MASTER_PORT'], flush=True); dist.destroy_process_group()"
    )
    job = _job(run_dir, RoleSpec(name="trainer", command=(PY, "-c", code), primary=True,
                                 ranks_per_replica=2, resources=Resources(cpus=2)))
    handle = slurm.submit(job)
    try:
        status = slurm.wait(handle, timeout=scaled(120))
    finally:
        _cancel_quietly(slurm, handle.job_id)
    lines = sorted(slurm.logs(handle.job_id, role="trainer"))
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), (status, lines)
    # srun --label prefixes each line with the task's rank.
    assert [ln.split(" port ")[0] for ln in lines] == ["0: rank 0 of 2 sum 3", "1: rank 1 of 2 sum 3"], lines
    ports = {ln.split(" port ")[1] for ln in lines}
    assert len(ports) == 1 and 10000 <= int(ports.pop()) < 32768, lines


def test_unknown_partition_is_a_one_line_user_error(slurm, run_dir):
    scheduler = SlurmScheduler(SlurmScheduler.Options(partition="no-such-partition"))
    with pytest.raises(SbatchRejected) as err:
        scheduler.submit(_job(run_dir, RoleSpec(name="trainer", command=("true",), primary=True)))
    msg = str(err.value)
    assert isinstance(err.value, UserError)
    assert "\n" not in msg and "partition" in msg.lower(), msg
    assert not (run_dir / "slurm" / "job_id").exists()


def test_unknown_job_id(slurm):
    with pytest.raises(JobNotFound):
        slurm.status("99999999")
    with pytest.raises(JobNotFound):
        slurm.status("not-a-number")


# ---------------------------------------------------------------- `forge run` end to end

FORGE = [PY, "-m", "forgerl.cli"]
# The tiny random model, small batches (as in test_run_e2e.py): seconds per step, so the
# time goes to starting Python, torch and the model in the Slurm step.
SMALL = [
    "--model", "tiny", "--generator", "hf", "--reward", "format", "--set", "rewards.0.options.pattern=\\d",
    "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=4", "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4", "--set", "scheduler.options.poll_interval=0.5",
]


def _forge(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, timeout=scaled(timeout), check=False)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # two attempts of a real run: about a minute or two on two busy cores
def test_forge_run_on_slurm_waits_and_a_requeued_run_resumes(slurm, tmp_path):
    """`forge run --scheduler slurm --wait` follows the job through a requeue: the second
    attempt resumes from the checkpoint the first one wrote and the run completes."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*FORGE, "run", *SMALL, "--scheduler", "slurm", "--steps", "4", "--output", str(out), "--wait",
         "--set", "checkpoint.every=1", "--set", "scheduler.options.requeue=true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "submission.json").exists(), 60, "the submission")
        job_id = json.loads((out / "submission.json").read_text())["job_id"]
        # Requeue once the first attempt has checkpointed a step (and before it is done).
        _wait_for(lambda: _steps(out)[:1] == [1] or proc.poll() is not None, 240, "step 1")
        assert proc.poll() is None, proc.communicate()
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
        assert requeue.returncode == 0, requeue.stderr
        _stdout, stderr = proc.communicate(timeout=scaled(400))
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", json.loads((out / "submission.json").read_text())["job_id"]], check=False)
    assert proc.returncode == 0, stderr[-3000:]
    assert "run completed" in stderr, stderr[-2000:]
    steps = _steps(out)
    assert steps[-1] == 4 and sorted(set(steps)) == [1, 2, 3, 4], steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4, summary
    batch = (out / "logs" / f"slurm-{job_id}.out").read_text()
    assert f"forge: job {job_id} attempt 0" in batch and f"forge: job {job_id} attempt 1" in batch, batch
    trainer_log = "\n".join(_forge("logs", str(out), "--role", "trainer").stdout.splitlines())
    assert "resumed from" in trainer_log, trainer_log[-3000:]
    status = _forge("status", str(out))
    assert status.returncode == 0 and f"{job_id}: completed (exit 0)" in status.stdout, status


def test_forge_cancel_and_status_of_a_slurm_run(slurm, tmp_path):
    out = tmp_path / "run"
    submitted = _forge("run", *SMALL, "--scheduler", "slurm", "--steps", "100", "--output", str(out))
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "submitted" in submitted.stdout, submitted.stdout
    job_id = json.loads((out / "submission.json").read_text())["job_id"]
    try:
        cancelled = _forge("cancel", str(out))
        assert cancelled.returncode == 0 and f"cancelled {job_id}" in cancelled.stdout, cancelled
        _wait_for(lambda: "cancelled" in _forge("status", str(out)).stdout, 60, "the job to end cancelled")
    finally:
        subprocess.run(["scancel", job_id], check=False)


def test_forge_run_bad_partition_is_one_line_exit_2(slurm, tmp_path):
    out = tmp_path / "run"
    proc = _forge("run", *SMALL, "--scheduler", "slurm", "--steps", "1", "--output", str(out),
                  "--set", "scheduler.options.partition=no-such-partition")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "partition" in proc.stderr, proc.stderr
    assert not (out / "submission.json").exists()


def test_forge_eval_on_slurm_writes_its_results_and_trains_nothing(slurm, tmp_path):
    """`forge eval` goes through the same launch path as `forge run`: on Slurm, one worker
    generates and scores every (problem, sample) pair and the results land in the folder."""
    out = tmp_path / "eval"
    proc = _forge("eval", "tiny", "--task", "arithmetic", "--generator", "hf", "--scheduler", "slurm",
                  "--problems", "4", "--k", "2", "--set", "loop.sampling.max_tokens=12",
                  "--set", "scheduler.options.poll_interval=0.5", "--output", str(out), "--wait", "-q",
                  timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "eval_summary.json").read_text())
    assert (summary["problems"], summary["samples"], summary["k"]) == (4, 8, 2), summary
    records = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted((r["problem_id"], r["index"]) for r in records) == sorted(
        {(r["problem_id"], i) for r in records for i in (0, 1)}
    ), "a (problem, sample) pair is missing or doubled"
    assert len(records) == 8
    assert not (out / "checkpoints").exists(), "an evaluation wrote checkpoints"
    job_id = json.loads((out / "submission.json").read_text())["job_id"]
    status = _forge("status", str(out))
    assert status.returncode == 0 and f"{job_id}: completed (exit 0)" in status.stdout, status
