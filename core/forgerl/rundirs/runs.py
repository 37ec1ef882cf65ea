"""Run directories and the job that executes a run.

A run directory holds everything about one run::

    config.yaml        the resolved config (what every process of the run loads: load_config)
    submission.json    which scheduler runs it, and its job id
    metrics.jsonl      one JSON object per training step
    summary.json       written when the run ends
    logs/              one log per role process
    checkpoints/       step-NNNNNN/ folders and a ``latest`` pointer
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError, JobNotFound, ResumeError
from forgerl.rundirs.diskerrors import write_failed
from forgerl.types import JobHandle, JobSpec, Resources, RoleSpec

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.backends import Backend
    from forgerl.configuration.config import RunConfig
    from forgerl.configuration.sections import BackendChoice
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import Registry

CONFIG_FILE = "config.yaml"
SUBMISSION_FILE = "submission.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def planned_run_dir(config: RunConfig) -> Path:
    """Where a fresh run of ``config`` will live (nothing is created)."""
    run_dir = Path(config.output) if config.output else default_run_dir()
    try:
        return run_dir.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise ConfigError(f"output {config.output!r} is not a usable path: {exc}") from None


def new_run_dir(config: RunConfig, run_dir: Path | None = None) -> Path:
    """Create the run directory for a fresh run (``run_dir``, else the config's output);
    refuse one that already holds a run."""
    run_dir = run_dir if run_dir is not None else planned_run_dir(config)
    check_output_location(run_dir)
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {str(run_dir)!r}: {exc.strerror}") from None
    return run_dir.resolve()


def check_output_location(run_dir: Path) -> None:
    """A fresh run can be created at ``run_dir``: it holds no run yet, and it or its nearest
    existing parent is a writable directory. Creates nothing."""
    try:
        if (run_dir / CONFIG_FILE).exists():
            raise ConfigError(
                f"run directory {str(run_dir)!r} already holds a run; resume it with "
                f"`forge run --resume {run_dir}` or choose another --output"
            )
        existing = run_dir
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            what = "is a file" if existing == run_dir else f"is inside {str(existing)!r}, which is a file"
            raise ConfigError(f"run directory {str(run_dir)!r} {what}; choose another --output")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(
                f"cannot create run directory {str(run_dir)!r}: {str(existing)!r} is not writable; "
                "choose another --output"
            )
    except OSError as exc:
        raise ConfigError(f"cannot use run directory {str(run_dir)!r}: {exc.strerror or exc}") from None


def existing_run_dir(path: str | Path) -> Path:
    run_dir = Path(path)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ResumeError(f"{str(run_dir)!r} is not a run directory (no {CONFIG_FILE}); give the --output of an earlier run")
    return run_dir.resolve()


#: What a checkpoint depends on: a resumed run may not change these (--set, --model, ...).
RESUME_FIXED = ("model", "objective", "task", "trainer.name", "loop.seed", "sft.data", "sft.task_demonstrations",
                "sft.format", "sft.loss_on", "sft.max_length", "sft.overlong", "sft.shuffle")
#: What the samples a `forge eval` already wrote were drawn and scored with: its resume keeps
#: them, so these may not change either (``eval.k`` and ``loop.eval_size`` may grow: more
#: samples or problems drawn the same way).
EVAL_RESUME_FIXED = ("loop.eval_temperature", "loop.sampling", "rewards", "environment")


def check_resume_changes(saved: RunConfig, given: RunConfig, run_dir: str | Path) -> None:
    """``forge run --resume DIR`` with flags or ``--set``: they apply on top of the run's
    saved config (more steps, other logging, another generator or transport), except for
    what the checkpoint was made with (:data:`RESUME_FIXED`), which would only fail later
    inside the trainer or the task."""
    if given.output is not None:
        raise ConfigError(
            f"--resume continues the run in {run_dir}; output is for new runs (remove it from --set)"
        )
    made_with = "the checkpoint was made with"
    fixed: tuple[str, ...] = RESUME_FIXED
    if saved.objective == "eval":
        fixed, made_with = RESUME_FIXED + EVAL_RESUME_FIXED, "the samples already written were made with"
    for dotted in fixed:
        before, after = saved.dump(), given.dump()
        for part in dotted.split("."):
            before, after = before[part], after[part]
        difference = _first_difference(before, after, dotted)
        if difference is not None:
            where, was, now = difference
            raise ConfigError(
                f"--resume {run_dir}: {where} cannot change when resuming ({made_with} "
                f"{_short(was)}, given {_short(now)}); start a new run with --output instead"
            )


def _first_difference(a: Any, b: Any, where: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if found is not None:
                return found
        return None
    return None if a == b else (where, a, b)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_config(run_dir: Path, registry: Registry) -> RunConfig:
    """The run's config as each of its processes uses it (a trainer rank, a server role):
    ``config.yaml`` read once and resolved against ``registry``, every backend's options
    validated into its options model (:func:`forgerl.registry.resolve.resolve`). The file is the
    description that crosses from ``forge run`` to the run's processes; no backend reads it."""
    from forgerl.configuration.config import read_yaml, validate_config
    from forgerl.registry.resolve import resolve

    config = validate_config(read_yaml(run_dir / CONFIG_FILE), source=str(run_dir / CONFIG_FILE))
    return resolve(config, registry)


def write_config(run_dir: Path, config: RunConfig, *, then: str = "run the command again") -> None:
    """config.yaml, whole or not at all; a disk that refuses it is one RunWriteError line."""
    path = run_dir / CONFIG_FILE
    try:
        atomic_write_text(path, config.to_yaml())
    except OSError as exc:
        raise write_failed(path, exc, then) from None


def atomic_write_text(path: Path, text: str) -> None:
    """Readers see the old file or the new one. When the write fails (a full disk), the
    temporary file is removed before the OSError goes on: a failed write leaves nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def append_line(path: Path, line: bytes) -> bool:
    """Append one line, whole or not at all, to a file that several processes append to
    (events.jsonl, a scheduler's log): one write on an O_APPEND descriptor, so lines never
    mix. A disk that takes only part of it (full) has the part cut off again, unless another
    process appended after it meanwhile (then readers skip the torn line, as they skip any
    line that is not JSON). False when the line is not there; never raises."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        wrote = os.write(fd, line)
        if wrote == len(line):
            return True
        end = os.lseek(fd, 0, os.SEEK_CUR)
        if os.fstat(fd).st_size == end:
            os.ftruncate(fd, end - wrote)
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def write_submission(run_dir: Path, handle: JobHandle) -> None:
    data = {"scheduler": handle.scheduler, "job_id": handle.job_id, "run_dir": handle.run_dir}
    path = run_dir / SUBMISSION_FILE
    try:
        atomic_write_text(path, json.dumps(data, indent=2))
    except OSError as exc:
        raise write_failed(path, exc, f"run `forge run --resume {run_dir}`") from None


def missing_dirs(run_dir: Path) -> list[Path]:
    """The folders :func:`new_run_dir` would create for ``run_dir``, deepest first."""
    missing = [run_dir / "logs"]
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_new_dirs(created: list[Path]) -> None:
    """Undo :func:`new_run_dir` after a failure before the run started: remove the folders
    it created (given deepest first), each only while empty, so nothing else can go."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


def read_submission(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / SUBMISSION_FILE).read_text())
    except (OSError, ValueError):
        return None


def job_of_run_dir(run_dir: Path, submission: dict[str, Any]) -> str:
    """The job id ``forge status|logs|cancel RUN_DIR`` act on. A directory copied or moved
    elsewhere keeps the submission.json of where it was submitted: a job named by its
    directory (the local scheduler's) is then this directory's own; a job with an id of its
    own (Slurm's, Kubernetes') belongs to the original directory, and acting on it from the
    copy is refused, one line naming both."""
    job_id = str(submission["job_id"])
    recorded = submission.get("run_dir")
    here = run_dir.resolve()
    if not recorded or Path(recorded).resolve() == here:
        return job_id
    if job_id == recorded:
        return str(here)
    raise JobNotFound(
        f"{str(run_dir)!r} is a copy of the run directory {recorded} ({SUBMISSION_FILE} says so): job "
        f"{job_id} belongs to that run; give that directory, or the job id with --scheduler"
    )


def worker_command(run_dir: Path) -> tuple[str, ...]:
    """The command every trainer rank runs; it reads the run directory's config."""
    return (sys.executable, "-m", "forgerl.worker", "--run-dir", str(run_dir))


def server_role_command(run_dir: Path | str, role: str) -> tuple[str, ...]:
    """The command of every replica of server role ``role`` (:mod:`forgerl.server_role`): it
    loads the run's config and calls the ``serve`` of the backend that declares the role.
    The replica index comes from ``FORGE_REPLICA``, which every scheduler sets."""
    return (sys.executable, "-m", "forgerl.server_role", "--run-dir", str(run_dir), "--role", role)


def server_roles(
    config: RunConfig, registry: Registry, context: RunContext
) -> list[tuple[RoleSpec, Backend, BackendChoice, str]]:
    """Every server role the run's backends declare (the generator's, then each reward's, then
    the teacher's under ``objective: distill``), each with the backend, its choice and where
    the choice is in the config (``generator``, ``rewards.N``, ``distill.teacher``); a role
    shared by two rewards comes once per reward."""
    found: list[tuple[RoleSpec, Backend, BackendChoice, str]] = []
    choices: list[tuple[str, str, BackendChoice]] = [("generator", "generator", config.generator)]
    choices += [("reward", f"rewards.{index}", choice) for index, choice in enumerate(config.rewards)]
    if config.objective == "distill":
        choices.append(("teacher", "distill.teacher", config.distill.teacher))
    for kind, where, choice in choices:
        backend = registry.get(kind, choice.name)
        found += [(role, backend, choice, where) for role in backend.server_roles(choice.options, context=context)]
    return found


def build_job(config: RunConfig, registry: Registry, run_dir: Path) -> JobSpec:
    """The JobSpec of a run: trainer ranks (primary; rank 0 drives the loop) plus any
    server roles the generator (e.g. vLLM replicas) and the rewards (e.g. a served reward
    model) need; none of those for a supervised run that does not evaluate."""
    from forgerl.configuration.needs import uses_generator, uses_trainer
    from forgerl.interfaces import RunContext
    from forgerl.rundirs.allocator import trainer_allocator_env

    roles: list[RoleSpec] = [
        RoleSpec(
            name="trainer",
            command=worker_command(run_dir),
            replicas=1,
            # An evaluation's one worker drives the generator; it trains nothing.
            ranks_per_replica=config.trainer.ranks if uses_trainer(config) else 1,
            resources=Resources(cpus=1),
            primary=True,
            env=trainer_allocator_env(_launch_env(config)),
        )
    ]
    served = server_roles(config, registry, RunContext.for_run(config, run_dir)) if uses_generator(config) else []
    for role, _, _, where in served:
        roles = _add_role(roles, role, where)
    env = {"PYTHONUNBUFFERED": "1"}
    # OpenMP threads that spin while waiting turn a busy CPU into a 10x slowdown when a
    # run's processes and threads share cores (measured here: a 16x576x1536 matmul on 2
    # threads took 32 ms spinning, 1.9 ms passive). Must be set before torch loads.
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    if registry.plugin_refs:
        env["FORGE_PLUGINS"] = ",".join(registry.plugin_refs)
    return JobSpec(name=f"forge-{run_dir.name}", run_dir=str(run_dir), roles=tuple(roles), env=env)


def _launch_env(config: RunConfig) -> dict[str, str]:
    """The environment the trainer would have without forge's additions: this process's,
    then the scheduler's ``env`` option (Slurm and Kubernetes export it under role env)."""
    from forgerl.configuration.sections import options_dict

    env = dict(os.environ)
    scheduler_env = options_dict(config.scheduler.options).get("env")
    if isinstance(scheduler_env, dict):
        env.update({str(k): str(v) for k, v in scheduler_env.items()})
    return env


def _add_role(roles: list[RoleSpec], role: RoleSpec, owner: str) -> list[RoleSpec]:
    """``roles`` plus ``role``; a role already there under the same name is shared when it
    is the same role (two rewards served by one server), refused otherwise."""
    for existing in roles:
        if existing.name == role.name:
            if existing == role:
                return roles
            raise ConfigError(
                f"{owner} needs a server role named {role.name!r}, which another part of the run already uses"
            )
    return [*roles, role]
