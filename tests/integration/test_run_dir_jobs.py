"""`forge status|logs|cancel RUN_DIR` act on that directory's own job, with real local jobs.

A run directory keeps the submission.json and job.json written where it was submitted.
Copied elsewhere, it used to send `forge status COPY` and `forge cancel COPY` to the
original directory (the local job id is a path): the copy showed the original's state, and
cancelling the copy stopped the original's new run. A copy made while the job ran lists
the original's live processes. And `forge cancel` of a run that had finished printed
"cancelled". Jobs here are tiny ``python -c`` scripts started by the local scheduler, with
the submission and config a `forge run` writes; `forge` itself runs as a subprocess.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgerl.rundirs import runs
from forgerl.types import JobHandle, JobSpec, JobState, RoleSpec
from forgerl_plugins.schedulers.local.scheduler import LocalScheduler
from tests.helpers.timing import scaled, wait_until
from tests.unit.test_cli import assert_one_line_error, forge

pytestmark = pytest.mark.integration

SAY_AND_EXIT = "print('the first run', flush=True)"
SAY_AND_WAIT = "import signal; print('the second run', flush=True); signal.pause()"


class Jobs:
    """Local jobs started by this test, each supervised by a thread; cancelled at the end."""

    def __init__(self) -> None:
        self.scheduler = LocalScheduler(LocalScheduler.Options(stop_timeout=5.0))
        self.started: list[tuple[JobHandle, threading.Thread]] = []

    def start(self, run_dir: Path, code: str) -> JobHandle:
        from forgerl.configuration.config import validate_config

        role = RoleSpec("main", (sys.executable, "-c", code), primary=True)
        handle = self.scheduler.submit(JobSpec(f"forge-{run_dir.name}", str(run_dir), (role,)))
        # What `forge run` leaves beside the job: its config and where the job was submitted.
        runs.write_config(run_dir, validate_config({"model": {"name": "tiny"}, "generator": {"name": "hf"}}))
        runs.write_submission(run_dir, handle)
        supervisor = threading.Thread(target=self.scheduler.wait, args=(handle,), daemon=True)
        supervisor.start()
        self.started.append((handle, supervisor))
        return handle

    def state(self, run_dir: Path) -> JobState:
        return self.scheduler.status(str(run_dir)).state

    def finished(self, run_dir: Path) -> None:
        wait_until(lambda: self.state(run_dir).finished, scaled(60), f"the job in {run_dir} to finish")

    def running_and_said(self, run_dir: Path, words: str) -> None:
        def said() -> bool:
            log = run_dir / "logs" / "main-0.log"
            return self.state(run_dir) is JobState.RUNNING and log.is_file() and words in log.read_text()

        wait_until(said, scaled(60), f"the job in {run_dir} to run and say {words!r}")

    def close(self) -> None:
        for handle, supervisor in self.started:
            self.scheduler.cancel(handle.job_id)
            supervisor.join(timeout=scaled(30))


@pytest.fixture
def jobs() -> Iterator[Jobs]:
    opened = Jobs()
    try:
        yield opened
    finally:
        opened.close()


def test_a_copy_of_a_finished_run_is_its_own(tmp_path: Path, jobs: Jobs) -> None:
    original, copy = tmp_path / "original", tmp_path / "copy"
    jobs.start(original, SAY_AND_EXIT)
    jobs.finished(original)
    shutil.copytree(original, copy)
    jobs.start(original, SAY_AND_WAIT)  # the original directory runs again (e.g. resumed)
    jobs.running_and_said(original, "the second run")

    status = forge("status", str(copy))
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"{copy}: completed (exit 0)"), status.stdout

    logs = forge("logs", str(copy))
    assert logs.returncode == 0, logs.stderr
    assert "the first run" in logs.stdout and "the second run" not in logs.stdout, logs.stdout

    cancel = forge("cancel", str(copy))
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"{copy} had already finished: completed (exit 0); nothing to cancel"
    assert jobs.state(original) is JobState.RUNNING, "cancelling the copy stopped the original's job"


def test_a_copy_made_while_the_job_ran_cannot_stop_that_job(tmp_path: Path, jobs: Jobs) -> None:
    original, copy = tmp_path / "original", tmp_path / "copy"
    jobs.start(original, SAY_AND_WAIT)
    jobs.running_and_said(original, "the second run")
    shutil.copytree(original, copy)  # its job.json lists the original's live processes

    status = forge("status", str(copy))
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"{copy}: unknown - a copy of the run directory {original}"), status.stdout

    assert_one_line_error(forge("cancel", str(copy)), str(copy), f"a copy of the run directory {original}")
    assert jobs.state(original) is JobState.RUNNING, "cancelling the copy stopped the original's job"
    assert not (original / "cancel-requested").exists() and not (copy / "cancel-requested").exists()


def test_cancel_of_a_finished_run_says_so_and_changes_nothing(tmp_path: Path, jobs: Jobs) -> None:
    run_dir = tmp_path / "run"
    jobs.start(run_dir, SAY_AND_EXIT)
    jobs.finished(run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    cancel = forge("cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"{run_dir} had already finished: completed (exit 0); nothing to cancel"
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert forge("status", str(run_dir)).stdout.startswith(f"{run_dir}: completed (exit 0)")


def test_a_copy_of_a_run_with_its_own_job_id_is_refused(tmp_path: Path) -> None:
    """Slurm's and Kubernetes' job ids name a job, not a directory: from a copy, that job is
    the original's, and acting on it is refused before any scheduler is asked."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    copy.mkdir()
    submission = {"scheduler": "slurm", "job_id": "4242", "run_dir": str(original)}
    (copy / runs.SUBMISSION_FILE).write_text(json.dumps(submission))
    for command in ("status", "cancel", "logs"):
        assert_one_line_error(forge(command, str(copy)), f"a copy of the run directory {original}", "4242")
