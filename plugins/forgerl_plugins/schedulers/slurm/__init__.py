"""``slurm``: sbatch/srun.

One allocation per run: each role replica is an ``srun`` step placed on explicit nodes of
the allocation (see :mod:`.render`); ``forge status|logs|cancel`` use squeue, scontrol,
``sacct -c`` and scancel. The backend is :class:`.scheduler.SlurmScheduler`, its options
nested in it.
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return ["forgerl_plugins.schedulers.slurm.scheduler:SlurmScheduler"]
