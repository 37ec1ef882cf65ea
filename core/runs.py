"""Run directories and the job that executes a run.

A run directory holds everything about one run::

    config.yaml        the resolved config (what the workers read)
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

from forgerl.errors import ConfigError, ResumeError
from forgerl.types import JobHandle, JobSpec, Resources, RoleSpec

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.config import RunConfig
    from forgerl.plugins import Registry

CONFIG_FILE = "config.yaml"
SUBMISSION_FILE = "submission.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def new_run_dir(config: "RunConfig") -> Path:
    """Create the run directory for a fresh run; refuse one that already holds a run."""
    run_dir = Path(config.output) if config.output else default_run_dir()
    if (run_dir / CONFIG_FILE).exists():
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; resume it with "
            f"`forge run --resume {run_dir}` or choose another --output"
        )
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {str(run_dir)!r}: {exc.strerror}") from None
    return run_dir.resolve()


def existing_run_dir(path: str | Path) -> Path:
    run_dir = Path(path)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ResumeError(f"{str(run_dir)!r} is not a run directory (no {CONFIG_FILE}); give the --output of an earlier run")
    return run_dir.resolve()


def write_config(run_dir: Path, config: "RunConfig") -> None:
    atomic_write_text(run_dir / CONFIG_FILE, config.to_yaml())


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_submission(run_dir: Path, handle: JobHandle) -> None:
    data = {"scheduler": handle.scheduler, "job_id": handle.job_id, "run_dir": handle.run_dir}
    atomic_write_text(run_dir / SUBMISSION_FILE, json.dumps(data, indent=2))


def read_submission(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / SUBMISSION_FILE).read_text())
    except (OSError, ValueError):
        return None


def worker_command(run_dir: Path) -> tuple[str, ...]:
    """The command every trainer rank runs; it reads the run directory's config."""
    return (sys.executable, "-m", "forgerl.worker", "--run-dir", str(run_dir))


def build_job(config: "RunConfig", registry: "Registry", run_dir: Path) -> JobSpec:
    """The JobSpec of a run: trainer ranks (primary; rank 0 drives the loop) plus any
    server roles the generator needs (e.g. vLLM replicas)."""
    from forgerl.interfaces import RunContext

    roles: list[RoleSpec] = [
        RoleSpec(
            name="trainer",
            command=worker_command(run_dir),
            replicas=1,
            ranks_per_replica=config.trainer.ranks,
            resources=Resources(cpus=1),
            primary=True,
        )
    ]
    gen_backend = registry.get("generator", config.generator.name)
    roles_fn = getattr(gen_backend, "roles", None)
    if roles_fn is not None:
        if isinstance(roles_fn, str):
            import importlib

            module, _, attr = roles_fn.partition(":")
            roles_fn = getattr(importlib.import_module(module), attr)
        ctx = RunContext(config=config, run_dir=run_dir)
        roles += list(roles_fn(gen_backend.validate_options(config.generator.options), ctx))
    env = {"PYTHONUNBUFFERED": "1"}
    # OpenMP threads that spin while waiting turn a busy CPU into a 10x slowdown when a
    # run's processes and threads share cores (measured here: a 16x576x1536 matmul on 2
    # threads took 32 ms spinning, 1.9 ms passive). Must be set before torch loads.
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    if registry.plugin_refs:
        env["FORGE_PLUGINS"] = ",".join(registry.plugin_refs)
    return JobSpec(name=f"forge-{run_dir.name}", run_dir=str(run_dir), roles=tuple(roles), env=env)
