"""``slurm``: sbatch/srun.

One allocation per run: each role replica is an ``srun`` step placed on explicit nodes of
the allocation (see :mod:`.render`); ``forge status|logs|cancel`` use squeue, scontrol,
``sacct -c`` and scancel. Nothing is imported here: the options model is in :mod:`.options`.
"""

from __future__ import annotations

from forgerl.backends import SchedulerBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="slurm",
            factory="forgerl_plugins.schedulers.slurm.scheduler:SlurmScheduler",
            options="forgerl_plugins.schedulers.slurm.options:SlurmSchedulerOptions",
            description="Slurm batch jobs (sbatch/srun)",
            info={"needs": "sbatch, squeue, scontrol, scancel on PATH (a Slurm login node)"},
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("SlurmSchedulerOptions", "slurm_memory", "memory_mb", "MEMORY_RE", "TIME_RE"))
