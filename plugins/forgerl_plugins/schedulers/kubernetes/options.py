"""The ``kubernetes`` scheduler's options (``KubernetesScheduler.Options``, with its volumes and
tolerations), in a module of their own so that the parts the class assembles
(:mod:`.manifests`) read them without importing the class."""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from forgerl.options import OptionsModel

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Kubernetes resource quantity (cpu, memory, ephemeral storage): "16Gi", "500m", "1e3".
QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkKMGTPE]i?)?$")


class Volume(OptionsModel):
    """A volume mounted into every pod: a PersistentVolumeClaim or a hostPath."""

    name: str = Field(description="Volume name (a DNS label).")
    mount_path: str = Field(description="Where it appears in the containers (absolute).")
    pvc: str | None = Field(None, description="Name of a PersistentVolumeClaim in the namespace.")
    host_path: str | None = Field(None, description="A directory on the node (single-node or shared mounts).")
    read_only: bool = False
    sub_path: str | None = Field(None, description="Mount only this sub-directory of the volume.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not DNS_LABEL.match(v):
            raise ValueError(f"volume name {v!r} must be a DNS label (lowercase letters, digits, '-')")
        return v

    @field_validator("mount_path", "host_path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not posixpath.isabs(v):
            raise ValueError(f"path {v!r} must be absolute")
        return None if v is None else posixpath.normpath(v)

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError(f"volume {self.name!r}: give exactly one of pvc or host_path")
        return self


class Toleration(OptionsModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)


class Options(OptionsModel):
    namespace: str = Field("default", description="Namespace the run's objects are created in.")
    image: str | None = Field(None, description="Container image with forgerl installed (required).")
    python: str = Field(
        "python", description="The image's Python: a role command that starts with this machine's interpreter "
        "(sys.executable, as forge's own roles do) runs with it instead."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[str] = Field(default_factory=list)
    use_jobset: bool = Field(
        True, description="One JobSet (jobset.x-k8s.io) for the run; false: an Indexed Job per role replica "
        "plus a headless Service (for clusters without JobSet)."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    service_account: str | None = None
    priority_class: str | None = None
    volumes: list[Volume] = Field(
        default_factory=list,
        description="Volumes for the model, checkpoints and the run directory (which must be on one).",
    )
    shm_size: str | None = Field(
        None, description="Size of a memory-backed /dev/shm (NCCL and data loaders need more than 64Mi)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment of every container.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every object and pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on every pod.")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of a GPU.")
    master_port: int = Field(29500, ge=1, le=65535, description="torch.distributed rendezvous port (per pod IP).")
    max_restarts: int = Field(0, ge=0, description="JobSet failurePolicy.maxRestarts: restarts of the whole run.")
    active_deadline_seconds: int | None = Field(None, ge=1, description="Time limit of each Job.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="Delete finished objects after this.")
    kubeconfig: str | None = Field(None, description="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, "
                                   "or the in-cluster service account).")
    context: str | None = Field(None, description="Kubeconfig context (default: the current one).")
    poll_interval: float = Field(
        5.0, gt=0, le=3600, description="Longest wait between status checks in --wait."
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not DNS_LABEL.match(v):
            raise ValueError(f"namespace {v!r} must be a DNS label (lowercase letters, digits, '-')")
        return v

    @field_validator("shm_size")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not QUANTITY.match(v):
            raise ValueError(f"invalid quantity {v!r}: use e.g. '16Gi' or '512Mi'")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key):
                raise ValueError(f"env name {key!r} is not a valid environment variable name")
        return v

    @model_validator(mode="after")
    def _unique_volumes(self) -> Options:
        names = [v.name for v in self.volumes]
        if len(set(names)) != len(names):
            raise ValueError(f"volume names must be unique, got {names}")
        return self
