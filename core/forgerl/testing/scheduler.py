"""The Scheduler kit: what ``forge run|status|logs|cancel`` rely on from a scheduler, checked
against one backend by name with small real jobs.

Every job's roles run a short Python program (:mod:`forgerl.testing.scheduler_support`)
that records which processes it started and on which host; where a job runs on this
machine the kit checks by pid that they are gone. What it checks (each a test of
:class:`SchedulerContract`):

- ``check()`` returns, or raises a one-line :class:`~forgerl.errors.UserError` (something
  the user can fix: no ``sbatch`` on PATH, no kubeconfig); the kit skips the job checks
  then, with that line as the reason (or fails them when ``required``);
- ``render(job)`` returns the text ``--dry-run`` prints, naming the roles' commands;
- a job whose primary role waits for the kit reaches RUNNING (the role runs); ``wait``
  with a timeout returns about then, with a status that is not final (or raises
  :class:`~forgerl.errors.SchedulerError`), and the job goes on; once the role exits 0,
  ``wait`` returns COMPLETED with exit code 0, the non-primary role (a server that would
  run forever) is stopped, and a new instance built from the same options (as ``forge
  status`` in another process builds one) reports COMPLETED too;
- a primary role that exits with status 3 makes the job FAILED with exit code 3;
- ``cancel`` of a running job ends every process of it, children of the roles included;
  ``wait`` then returns CANCELLED (or raises :class:`~forgerl.errors.JobNotFound` for a
  scheduler that deletes a cancelled job's records, as Kubernetes deletes its objects);
- ``status`` of a job id the scheduler never issued raises :class:`~forgerl.errors.JobNotFound`;
- ``supports_logs`` is honest: True exactly when the class overrides ``logs``; then
  ``logs(job_id)`` holds what each role printed and ``logs(job_id, role=...)`` that role's
  lines only (each line may carry a prefix naming its process).

A subclass names the backend (``backend``), its options as a config holds them
(``options``; an autouse fixture of the subclass may set ``self.options`` per test, e.g.
to a cluster it starts), the plugins to load when it is not installed (``plugins``), and
may override :meth:`SchedulerContract.unavailable` to skip, with the reason, where the
scheduler cannot run (no cluster answers). Deadlines are class attributes, in seconds,
scaled by ``FORGE_TEST_TIMEOUT_SCALE``.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import pytest

from forgerl.testing.registry import backend_under_test
from forgerl.testing.scheduler_support import (
    DONE,
    FAILS,
    STARTED,
    kill_leftovers,
    read_record,
    role_command,
    still_running,
)
from forgerl.testing.timing import hard_limit, scaled, wait_until

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Scheduler
    from forgerl.types import JobHandle, JobSpec, JobStatus

#: (scheduler, job id, run directory) of every job a test submitted (the ``jobs`` fixture).
SubmittedJobs: TypeAlias = "list[tuple[Scheduler, str, Path]]"


class SchedulerContract:
    """Base class of a plugin's scheduler conformance tests (see the module's docstring)."""

    #: The scheduler's backend name, as ``scheduler.name`` in a config.
    backend: ClassVar[str] = ""
    #: Its options, as ``scheduler.options`` holds them (plain data).
    options: Mapping[str, Any] = {}
    #: Plugin modules to load besides the installed ones (import paths).
    plugins: ClassVar[Sequence[str]] = ()
    #: Fail, rather than skip, when the scheduler cannot be used here.
    required: ClassVar[bool] = False
    #: The interpreter the job's roles start with (forge's own roles use this machine's).
    python: ClassVar[str] = sys.executable
    #: Seconds (scaled) for a submitted job's role to start (queueing included).
    start_timeout_s: ClassVar[float] = 120
    #: Seconds (scaled) for a job to end once its primary role exits, or once cancelled.
    end_timeout_s: ClassVar[float] = 120
    #: Seconds (scaled) for a role's processes to be gone once its job ended.
    stopped_timeout_s: ClassVar[float] = 30
    #: Seconds (scaled) beyond its timeout a ``wait(timeout=...)`` may take to return.
    wait_slack_s: ClassVar[float] = 10
    #: Seconds (scaled) each test may run before it fails instead of hanging the suite.
    hard_limit_s: ClassVar[float] = 400

    # ------------------------------------------------------------------- hooks

    def unavailable(self) -> str | None:
        """Why the scheduler cannot be checked here (the tests skip with it), or None."""
        return None

    def job_run_dir(self, tmp_path: Path, name: str) -> Path:
        """The run directory of a test job: it must be where the job's processes see it
        at the same path (the kit and the roles exchange files there)."""
        return tmp_path / name

    # ---------------------------------------------------------------- fixtures

    @pytest.fixture(autouse=True)
    def _hard_timeout(self, request: pytest.FixtureRequest) -> Iterator[None]:
        limit = max(1, int(scaled(self.hard_limit_s)))
        with hard_limit(limit, f"{request.node.nodeid} ran past its hard timeout of {limit} s"):
            yield

    @pytest.fixture
    def scheduler(self) -> Scheduler:
        """The scheduler under test, built as a run builds it, after ``check()`` passed."""
        from forgerl.errors import UserError

        reason = self.unavailable()
        if reason is not None:
            self._cannot_run(reason)
        scheduler = self.build()
        try:
            scheduler.check()
        except UserError as exc:
            self._cannot_run(f"{self.backend}: check() says {exc}")
        return scheduler

    @pytest.fixture
    def jobs(self) -> Iterator[SubmittedJobs]:
        """(scheduler, job id, run directory) of every job a test submits: cancelled at
        teardown whatever happened, and whatever its roles left running killed."""
        submitted: SubmittedJobs = []
        yield submitted
        self.clean_up(submitted)

    # ----------------------------------------------------------------- helpers

    def build(self) -> Scheduler:
        """A new instance, built as ``forge`` builds one: the backend's class, ``Class(options)``."""
        record = backend_under_test("scheduler", self.backend, self.plugins, required=self.required)
        return record.build(dict(self.options))

    def clean_up(self, submitted: SubmittedJobs) -> None:
        """Cancel the jobs still running; kill what their roles left running."""
        for scheduler, job_id, run_dir in submitted:
            try:
                if not scheduler.status(job_id).state.finished:
                    scheduler.cancel(job_id)
            except Exception:  # noqa: BLE001 - the test's own failure is what matters
                pass
            for record in run_dir.glob("*.json"):
                kill_leftovers(read_record(run_dir, record.stem))

    def _cannot_run(self, reason: str) -> None:
        if self.required:
            pytest.fail(f"scheduler {self.backend!r} must be usable here, but: {reason}", pytrace=False)
        pytest.skip(reason)

    def job(self, tmp_path: Path, *roles: tuple[str, str, bool]) -> JobSpec:
        """A job of ``(name, mode, primary)`` roles (modes: see scheduler_support), with a
        fresh name and run directory."""
        from forgerl.types import JobSpec, Resources, RoleSpec

        name = f"kit-{uuid.uuid4().hex[:8]}"
        run_dir = self.job_run_dir(tmp_path, name)
        run_dir.mkdir(parents=True, exist_ok=True)
        seconds = scaled(600)
        specs = tuple(
            RoleSpec(
                name=role,
                command=role_command(self.python, mode, str(run_dir), role, seconds),
                primary=primary,
                resources=Resources(cpus=1),
            )
            for role, mode, primary in roles
        )
        return JobSpec(name=name, run_dir=str(run_dir), roles=specs)

    def submit(self, scheduler: Scheduler, job: JobSpec, jobs: SubmittedJobs) -> JobHandle:
        handle = scheduler.submit(job)
        jobs.append((scheduler, handle.job_id, Path(job.run_dir)))
        assert handle.job_id, f"submit returned an empty job id: {handle}"
        return handle

    def wait_started(self, scheduler: Scheduler, handle: JobHandle, role: str) -> dict[str, Any]:
        """The role's record, once it runs; fails when the job ends first."""
        run_dir = Path(handle.run_dir)

        def started() -> dict[str, Any] | None:
            record = read_record(run_dir, role)
            if record is None and scheduler.status(handle.job_id).state.finished:
                status = scheduler.status(handle.job_id)
                raise AssertionError(f"the job ended before role {role!r} started: {status}")
            return record

        # status() may start a process (squeue, an API call): poll gently.
        return wait_until(started, self.start_timeout_s, f"role {role!r} of job {handle.job_id} to start", 0.3)

    def wait_final(self, scheduler: Scheduler, handle: JobHandle) -> JobStatus:
        status = scheduler.wait(handle, timeout=scaled(self.end_timeout_s))
        assert status.state.finished, (
            f"wait(timeout={scaled(self.end_timeout_s):g}) returned {status} for a job that should have ended"
        )
        return status

    def assert_stopped(self, record: dict[str, Any] | None, what: str) -> None:
        wait_until(lambda: not still_running(record), self.stopped_timeout_s, f"{what} to be stopped")

    # ------------------------------------------------------------------- tests

    def test_check_passes_or_raises_a_user_error(self) -> None:
        from forgerl.errors import UserError

        reason = self.unavailable()
        if reason is not None:
            self._cannot_run(reason)
        try:
            self.build().check()
        except UserError as exc:
            assert str(exc).strip() and "\n" not in str(exc).strip(), f"check()'s error is not one line: {exc!r}"
        except Exception as exc:
            raise AssertionError(
                f"check() raised {type(exc).__name__}: {exc}; a scheduler that cannot submit from here "
                "raises a forgerl.errors.UserError saying what to fix (forge prints it as one line)"
            ) from exc

    def test_render_shows_the_job(self, tmp_path: Path) -> None:
        scheduler = self.build()
        job = self.job(tmp_path, ("trainer", "gate", True), ("server", "forever", False))
        text = scheduler.render(job)
        assert isinstance(text, str) and text.strip(), f"render() returned {text!r}: --dry-run would print nothing"
        assert "forge-kit" in text, "render() does not show the roles' commands"

    def test_job_runs_then_completes_with_exit_status_0(self, scheduler: Scheduler, tmp_path: Path, jobs: SubmittedJobs) -> None:
        from forgerl.errors import SchedulerError
        from forgerl.types import JobState

        job = self.job(tmp_path, ("trainer", "gate", True), ("server", "forever", False))
        handle = self.submit(scheduler, job, jobs)
        self.wait_started(scheduler, handle, "trainer")
        status = scheduler.status(handle.job_id)
        assert status.state is JobState.RUNNING, f"status() of a job whose role runs: {status}"
        server = self.wait_started(scheduler, handle, "server")

        # wait() with a timeout returns about then; the job goes on.
        start = time.monotonic()
        try:
            interim = scheduler.wait(handle, timeout=1.0)
            assert not interim.state.finished, f"wait(timeout=1) on a running job returned {interim}"
        except SchedulerError:
            pass  # allowed: "return the current status, or raise SchedulerError"
        took = time.monotonic() - start
        assert took < 1.0 + scaled(self.wait_slack_s), f"wait(timeout=1) returned after {took:.1f} s"

        (Path(job.run_dir) / "go").touch()
        final = self.wait_final(scheduler, handle)
        assert (final.state, final.exit_code) == (JobState.COMPLETED, 0), (
            f"the primary role exited 0, but the job ended {final}"
        )
        self.assert_stopped(server, "the non-primary role 'server' (the job ended with the primary)")
        again = self.build().status(handle.job_id)
        assert (again.state, again.exit_code) == (JobState.COMPLETED, 0), (
            f"a new {self.backend} instance (as `forge status` builds one) reports {again}"
        )
        if type(scheduler).supports_logs:
            every = list(scheduler.logs(handle.job_id))
            done, started = DONE.format(name="trainer"), STARTED.format(name="server")
            assert any(line.endswith(done) for line in every), f"logs() lacks the line {done!r}: {every[-20:]}"
            assert any(line.endswith(started) for line in every), f"logs() lacks the line {started!r}: {every[-20:]}"
            trainer = list(scheduler.logs(handle.job_id, role="trainer"))
            assert any(line.endswith(done) for line in trainer), f"logs(role='trainer') lacks {done!r}: {trainer}"
            assert not any(line.endswith(started) for line in trainer), (
                f"logs(role='trainer') shows the 'server' role's lines: {trainer}"
            )

    def test_a_failing_role_fails_the_job_with_its_exit_status(
        self, scheduler: Scheduler, tmp_path: Path, jobs: SubmittedJobs
    ) -> None:
        from forgerl.types import JobState

        job = self.job(tmp_path, ("trainer", "fail", True))
        handle = self.submit(scheduler, job, jobs)
        final = self.wait_final(scheduler, handle)
        assert (final.state, final.exit_code) == (JobState.FAILED, 3), (
            f"the primary role exited with status 3, but the job ended {final}"
        )
        if type(scheduler).supports_logs:
            lines = list(scheduler.logs(handle.job_id))
            fails = FAILS.format(name="trainer")
            assert any(line.endswith(fails) for line in lines), f"logs() lacks what the role printed: {lines[-20:]}"

    def test_cancel_stops_every_process_of_a_running_job(
        self, scheduler: Scheduler, tmp_path: Path, jobs: SubmittedJobs
    ) -> None:
        from forgerl.errors import JobNotFound
        from forgerl.types import JobState

        job = self.job(tmp_path, ("trainer", "forever", True))
        handle = self.submit(scheduler, job, jobs)
        record = self.wait_started(scheduler, handle, "trainer")
        status = scheduler.status(handle.job_id)
        assert status.state is JobState.RUNNING, f"status() of a job whose role runs: {status}"
        scheduler.cancel(handle.job_id)
        try:
            final = self.wait_final(scheduler, handle)
            assert final.state is JobState.CANCELLED, f"a cancelled job ended {final}"
        except JobNotFound:
            pass  # the scheduler deleted the job's records with it
        self.assert_stopped(record, "every process of the cancelled role (its child too)")

    def test_status_of_an_unknown_job_is_job_not_found(self, scheduler: Scheduler) -> None:
        from forgerl.errors import JobNotFound

        unknown = f"kit-no-such-job-{uuid.uuid4().hex[:8]}"
        try:
            status = scheduler.status(unknown)
        except JobNotFound as exc:
            assert "\n" not in str(exc).strip(), f"the error is not one line: {exc!r}"
            return
        except Exception as exc:
            raise AssertionError(
                f"status({unknown!r}) raised {type(exc).__name__}: {exc}; raise forgerl.errors.JobNotFound "
                "(`forge status` prints it as one line, exit status 2)"
            ) from exc
        raise AssertionError(f"status({unknown!r}) of a job never submitted returned {status}")

    def test_supports_logs_is_honest(self) -> None:
        from forgerl.interfaces import Scheduler

        cls = type(self.build())
        overrides = cls.logs is not Scheduler.logs
        if cls.supports_logs:
            assert overrides, f"{cls.__name__}.supports_logs is True but it does not implement logs()"
        else:
            assert not overrides, (
                f"{cls.__name__} implements logs() but supports_logs is False: `forge logs` never calls it"
            )
