"""The slurm scheduler against a real Slurm (scripts/slurm/start-local-slurm.sh starts one
on this machine). Skipped, with the reason, when no Slurm answers; FORGE_REQUIRE_SLURM=1
(as in CI) turns that skip into a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgerl.errors import JobNotFound, UserError
from forgerl.types import JobSpec, JobState, Resources, RoleSpec
from forgerl_plugins.schedulers.slurm import SlurmSchedulerOptions
from forgerl_plugins.schedulers.slurm.scheduler import SbatchRejected, SlurmScheduler

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

PY = sys.executable


def _slurm_answer() -> str | None:
    """None when a Slurm controller answers with a usable node, else why not."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no sinfo/sbatch on PATH"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 10 s"
    if proc.returncode != 0:
        return f"sinfo failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    states = proc.stdout.split()
    if not any(s.rstrip("*~#!%$@^-") in ("idle", "mix", "alloc", "comp") for s in states):
        return f"no usable Slurm node (states: {states})"
    return None


@pytest.fixture(scope="module")
def slurm() -> SlurmScheduler:
    why = _slurm_answer()
    if why is not None:
        msg = f"no Slurm running here ({why}); start one with scripts/slurm/start-local-slurm.sh"
        if os.environ.get("FORGE_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return SlurmScheduler(SlurmSchedulerOptions(poll_interval=0.5, stop_timeout=10))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _job(run_dir: Path, *roles: RoleSpec, name: str = "forge-test") -> JobSpec:
    return JobSpec(name=name, run_dir=str(run_dir), roles=roles)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.3)


def _cancel_quietly(slurm: SlurmScheduler, job_id: str) -> None:
    try:
        slurm.cancel(job_id)
    except Exception:  # the test's own assertion is what matters
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
        status = slurm.wait(handle, timeout=90)
    finally:
        _cancel_quietly(slurm, handle.job_id)
    took = time.monotonic() - start

    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status
    # The sidecar would sleep 600 s: the job ended because the primary did.
    assert took < 60, f"job took {took:.0f}s: the sidecar was not stopped when the primary ended"
    assert (run_dir / "primary.txt").read_text() == "trainer 0 0 1 hello there"
    assert (run_dir / "slurm" / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert (run_dir / "slurm" / "job_id").read_text().strip() == handle.job_id
    assert (run_dir / "logs" / "server.0.log").exists()
    assert list(slurm.logs(handle.job_id, role="trainer")) == ["primary done"]
    everything = list(slurm.logs(handle.job_id))
    assert "[trainer.0] primary done" in everything, everything
    assert any(line.startswith("[batch] forge: job ") for line in everything), everything
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
        status = slurm.wait(handle, timeout=90)
    finally:
        _cancel_quietly(slurm, handle.job_id)
    assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    lines = list(slurm.logs(handle.job_id, role="trainer"))
    # The role's output, then srun's own report of the failure.
    assert lines[0] == "boom" and "exit code 3" in " ".join(lines[1:]), lines


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
        status = slurm.wait(handle, timeout=60)
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
    scheduler = SlurmScheduler(SlurmSchedulerOptions(poll_interval=0.5, requeue=True))
    handle = scheduler.submit(_job(run_dir, RoleSpec(name="trainer", command=(PY, "-c", code), primary=True)))
    try:
        _wait_for(attempts.exists, 60, "the first attempt to start")
        proc = subprocess.run(["scontrol", "requeue", handle.job_id], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        # Slurm holds a requeued job for AuthInfo cred_expire seconds (10 in our config).
        status = scheduler.wait(handle, timeout=150)
    finally:
        _cancel_quietly(scheduler, handle.job_id)
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status
    assert attempts.read_text().split() == ["0", "1"]
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
        status = slurm.wait(handle, timeout=120)
    finally:
        _cancel_quietly(slurm, handle.job_id)
    lines = sorted(slurm.logs(handle.job_id, role="trainer"))
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), (status, lines)
    # srun --label prefixes each line with the task's rank.
    assert [ln.split(" port ")[0] for ln in lines] == ["0: rank 0 of 2 sum 3", "1: rank 1 of 2 sum 3"], lines
    ports = {ln.split(" port ")[1] for ln in lines}
    assert len(ports) == 1 and 10000 <= int(ports.pop()) < 32768, lines


def test_unknown_partition_is_a_one_line_user_error(slurm, run_dir):
    scheduler = SlurmScheduler(SlurmSchedulerOptions(partition="no-such-partition"))
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
