"""The embedding API: build a registry, load a config, run or submit it from Python.

See docs/embedding.md for a runnable example.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.configuration.config import RunConfig, build_config
from forgerl.errors import JobNotFound
from forgerl.interfaces import Scheduler
from forgerl.registry.plugins import Registry, build_registry
from forgerl.registry.resolve import resolve
from forgerl.rundirs import runs
from forgerl.types import JobHandle, JobSpec, JobStatus


def load_config(
    file: str | Path | None = None,
    *,
    sets: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
    base: Mapping[str, Any] | None = None,
    check_available: bool = False,
) -> RunConfig:
    """Defaults < ``base`` < ``file`` < ``flags`` < ``sets`` (``"dotted.key=value"``),
    validated, with every backend's options checked and filled in by the backend."""
    registry = registry or build_registry()
    config = build_config(file, sets=sets, flags=flags, base=base)
    return resolve(config, registry, check_available=check_available)


@dataclass
class Submission:
    """A submitted run: its directory, its scheduler and the scheduler's handle."""

    run_dir: Path
    handle: JobHandle
    scheduler: Scheduler
    job: JobSpec

    def wait(self, timeout: float | None = None) -> JobStatus:
        return self.scheduler.wait(self.handle, timeout)

    def summary(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / runs.SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None


@dataclass
class Plan:
    """What a run would do, before anything starts: for ``--dry-run`` and for submit."""

    config: RunConfig
    run_dir: Path
    job: JobSpec
    scheduler: Scheduler
    resumed: bool = False
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        return self.scheduler.render(self.job)


def plan(
    config: RunConfig,
    *,
    registry: Registry | None = None,
    resume_dir: str | Path | None = None,
    create: bool = True,
    restart: bool = False,
) -> Plan:
    """Resolve backends (they must be available here), choose the run directory, build the
    job and run the pre-flight checks (:mod:`forgerl.runloop.preflight`). With ``create`` the run
    directory is then created and config.yaml written: a mistake found before that leaves
    nothing behind. ``restart`` (with ``resume_dir``) trains that run again from step 0:
    allowed only where it has no checkpoint; its finished metrics rows are set aside."""
    from forgerl.models import from_run as run_model
    from forgerl.runloop import preflight, resuming

    registry = registry or build_registry()
    config = resolve(config, registry, check_available=True)
    scheduler = registry.require("scheduler", config.scheduler.name).build(config.scheduler.options)
    if create:
        scheduler.check()  # e.g. no sbatch: fail before a run directory appears
    notes: list[str] = []
    if scheduler.shares_filesystem:
        # Another run named as the model: the checkpoint it means now, for good (resume).
        config, pinned = run_model.pin(config)
        notes += [pinned] if pinned else []
    fresh = resume_dir is None
    run_dir = runs.planned_run_dir(config) if resume_dir is None else runs.existing_run_dir(resume_dir)
    if create or not fresh:
        config = config.model_copy(update={"output": str(run_dir)})
    job = runs.build_job(config, registry, run_dir)
    if not fresh:
        resuming.check(run_dir, config, restart=restart)
    preflight.check_run(config, registry, scheduler, job, run_dir=run_dir, fresh=fresh)
    if create:
        if fresh:
            created = runs.missing_dirs(run_dir)
            runs.new_run_dir(config, run_dir)
            try:
                runs.write_config(run_dir, config)
            except BaseException:
                runs.remove_new_dirs(created)  # a full disk at the start leaves nothing behind
                raise
        else:
            # Never rewritten to contradict the checkpoint: resuming.check ran first.
            runs.write_config(run_dir, config, then=f"run `forge run --resume {run_dir}` again")
        if restart:
            notes += resuming.set_aside_history(run_dir)
    return Plan(config, run_dir, job, scheduler, resumed=resume_dir is not None, notes=notes)


def submit(
    config: RunConfig,
    *,
    registry: Registry | None = None,
    resume_dir: str | Path | None = None,
) -> Submission:
    """Start the run through its scheduler and return at once (the local scheduler's
    processes run until :meth:`Submission.wait` supervises them)."""
    p = plan(config, registry=registry, resume_dir=resume_dir)
    handle = p.scheduler.submit(p.job)
    runs.write_submission(p.run_dir, handle)
    return Submission(p.run_dir, handle, p.scheduler, p.job)


def run(
    config: RunConfig,
    *,
    registry: Registry | None = None,
    resume_dir: str | Path | None = None,
    timeout: float | None = None,
) -> tuple[JobStatus, Submission]:
    """Submit the run and wait for it to end; returns the final status and the submission."""
    sub = submit(config, registry=registry, resume_dir=resume_dir)
    return sub.wait(timeout), sub


def job_scheduler(
    job: str | Path, scheduler_name: str | None = None, *, registry: Registry | None = None
) -> tuple[Scheduler, str, str]:
    """The scheduler that holds ``job``, the job's id there and the scheduler's name, for
    ``status``, ``logs`` and ``cancel``. ``job`` is a run directory (any scheduler: read
    from its submission record, with the run's own scheduler options, which say where its
    job lives: a namespace, a partition) or a scheduler's job id with ``scheduler_name``.
    Raises JobNotFound (one line) when neither says where the job is."""
    registry = registry or build_registry()
    path = Path(job)
    job_id = str(job)
    if path.is_dir():
        sub = runs.read_submission(path)
        if sub is None:
            raise JobNotFound(f"{str(job)!r} has no {runs.SUBMISSION_FILE}: it was never submitted")
        scheduler_name = scheduler_name or sub["scheduler"]
        job_id = runs.job_of_run_dir(path, sub)
    if scheduler_name is None:
        raise JobNotFound(f"{str(job)!r} is not a run directory; give the scheduler too, e.g. `--scheduler slurm`")
    backend = registry.require("scheduler", scheduler_name)
    options = None  # the scheduler's defaults
    if path.is_dir():
        from forgerl.configuration.config import read_yaml, validate_config

        # A config that cannot be read is an error (one line naming the file), never
        # silently replaced by defaults that would ask the wrong place.
        config_file = path / runs.CONFIG_FILE
        cfg = validate_config(read_yaml(config_file), source=str(config_file))
        if cfg.scheduler.name == scheduler_name:
            options = cfg.scheduler.options
    return backend.build(options), job_id, scheduler_name
