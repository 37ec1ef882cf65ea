"""``slurm``: sbatch/srun."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import SchedulerBackend
from forgerl.hookspecs import hookimpl


class SlurmSchedulerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    constraint: str | None = None
    extra_sbatch: list[str] = Field(default_factory=list)
    requeue: bool = False


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="slurm",
            factory=None,
            options=SlurmSchedulerOptions,
            description="Slurm batch jobs (sbatch/srun)",
            implemented=False,
        )
    ]
