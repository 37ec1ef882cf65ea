"""The ``slurm`` scheduler's options (``SlurmScheduler.Options``), in a module of their own so
that the parts the class assembles (:mod:`.render`) read them without importing the class."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from forgerl.options import OptionsModel
from forgerl_plugins.schedulers.slurm.syntax import TIME_RE, slurm_memory


class Options(OptionsModel):
    partition: str | None = Field(None, description="#SBATCH --partition (default: the cluster's default).")
    account: str | None = Field(None, description="#SBATCH --account.")
    qos: str | None = Field(None, description="#SBATCH --qos.")
    time: str | None = Field(None, description="Time limit, Slurm syntax: '90', '1:00:00', '2-00:00:00'.")
    nodes: int | None = Field(
        None, ge=1, description="Nodes to allocate; default: as many as the roles' placement needs."
    )
    gpus_per_node: int = Field(
        0, ge=0, description="GPUs each node has; replicas are packed onto nodes within it."
    )
    cpus_per_node: int | None = Field(
        None, ge=1, description="CPUs usable per node; when set, replicas are packed within it too."
    )
    memory: str | None = Field(
        None, description="#SBATCH --mem per node (default: the sum of the roles' memory on a node)."
    )
    exclusive: bool = Field(False, description="#SBATCH --exclusive: whole nodes for the run.")
    constraint: str | None = Field(None, description="#SBATCH --constraint (node features).")
    extra_sbatch: list[str] = Field(
        default_factory=list, description="More #SBATCH options, e.g. '--reservation=r1' or '--mail-type=END'."
    )
    srun_args: list[str] = Field(default_factory=list, description="Extra options for every srun step.")
    requeue: bool = Field(
        False,
        description="#SBATCH --requeue: a preempted or requeued job runs again (FORGE_REQUEUED>0) and "
        "resumes from its last checkpoint.",
    )
    container_image: str | None = Field(None, description="pyxis --container-image for every step.")
    container_mounts: list[str] = Field(
        default_factory=list, description="pyxis --container-mounts, each 'SRC:DST[:FLAGS]'."
    )
    container_workdir: str | None = Field(None, description="pyxis --container-workdir.")
    container_python: str = Field(
        "python", description="With container_image: the image's Python, used for role commands that start "
        "with this machine's interpreter (sys.executable, as forge's own roles do)."
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run at the top of the batch script (module load, source a venv).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment exported to every step.")
    stop_timeout: float = Field(
        30.0, gt=0, le=86_400, description="Seconds the other roles get to exit after the primary role ends."
    )
    poll_interval: float = Field(5.0, gt=0, le=3600, description="Seconds between status checks in --wait.")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        return None if v is None else slurm_memory(v)

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not TIME_RE.match(v.strip()):
            raise ValueError(
                f"invalid time {v!r}: use minutes ('90'), 'H:MM:SS' ('1:00:00') or 'D-HH:MM:SS' ('2-00:00:00')"
            )
        return None if v is None else v.strip()

    @field_validator("extra_sbatch")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        out = []
        for line in v:
            line = line.strip()
            line = line[len("#SBATCH") :].strip() if line.startswith("#SBATCH") else line
            if not line.startswith("-") or "\n" in line:
                raise ValueError(f"extra_sbatch entry {line!r}: expected one sbatch option such as '--exclusive'")
            out.append(line)
        return out

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"env name {key!r} is not a valid environment variable name")
        return v
