"""Whether a job fits on this machine, checked before anything of a run is created.

A process per rank, at least one core per rank (as Slurm's ``--cpus-per-task`` is
derived), ``Resources.gpus`` per replica. Each role must fit the cores this process may
use (its CPU affinity); all roles together may use at most twice that, because a run's
roles largely take turns (generation, then training) rather than compete. GPUs are never
shared. ``scheduler.options.oversubscribe: true`` lifts the CPU and GPU limits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from forgerl.errors import ConfigError
from forgerl.types import JobSpec, RoleSpec

#: Roles together may need this many times the usable cores (they take turns).
SHARED_CORES_FACTOR = 2


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask; taskset and cpusets narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def visible_gpus() -> int:
    """NVIDIA GPUs a process started here would see: the driver's count, narrowed by
    CUDA_VISIBLE_DEVICES (CUDA stops at the first invalid entry, e.g. ``-1``)."""
    physical = _physical_gpus()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return physical
    listed = 0
    for entry in env.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        listed += 1
    return min(listed, physical) if physical else listed


def _physical_gpus() -> int:
    proc = Path("/proc/driver/nvidia/gpus")
    try:
        if proc.is_dir():
            return sum(1 for _ in proc.iterdir())
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def role_cpus(role: RoleSpec) -> int:
    return role.replicas * max(role.resources.cpus, role.ranks_per_replica)


def role_gpus(role: RoleSpec) -> int:
    return role.replicas * role.resources.gpus


def check_placement(job: JobSpec, *, cpus: int | None = None, gpus: int | None = None) -> None:
    """ConfigError (one line, naming the numbers) when ``job`` cannot be placed here."""
    cpus = usable_cpus() if cpus is None else cpus
    hint = "lower trainer.ranks or the generator's replicas, run on a cluster scheduler (--scheduler slurm), " \
        "or set scheduler.options.oversubscribe: true"
    for role in job.roles:
        need = role_cpus(role)
        if need > cpus:
            raise ConfigError(
                f"the local scheduler cannot place role {role.name!r}: it needs {need} CPU cores "
                f"({_shape(role)}), and this machine lets forge use {cpus}; {hint}"
            )
    total = sum(role_cpus(r) for r in job.roles)
    if total > SHARED_CORES_FACTOR * cpus:
        parts = ", ".join(f"{r.name} {role_cpus(r)}" for r in job.roles)
        raise ConfigError(
            f"the local scheduler cannot place this run: its roles need {total} CPU cores together "
            f"({parts}), more than {SHARED_CORES_FACTOR} x the {cpus} this machine lets forge use; {hint}"
        )
    gpu_need = sum(role_gpus(r) for r in job.roles)
    if gpu_need:
        gpus = visible_gpus() if gpus is None else gpus
        if gpu_need > gpus:
            parts = ", ".join(f"{r.name} {role_gpus(r)}" for r in job.roles if role_gpus(r))
            raise ConfigError(
                f"the local scheduler cannot place this run: it needs {gpu_need} GPUs ({parts}), "
                f"and this machine shows {gpus} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"{hint}"
            )


def _shape(role: RoleSpec) -> str:
    ranks = f" x {role.ranks_per_replica} ranks" if role.ranks_per_replica > 1 else ""
    per = f", {role.resources.cpus} cores each" if role.resources.cpus > 1 else ""
    return f"{role.replicas} replica{'s' * (role.replicas != 1)}{ranks}{per}"
