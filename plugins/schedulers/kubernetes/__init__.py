"""``kubernetes``: JobSet or Indexed Job manifests via the official client."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import SchedulerBackend
from forgerl.hookspecs import hookimpl


class KubernetesSchedulerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str = "default"
    image: str | None = None
    use_jobset: bool = True
    node_selector: dict[str, str] = Field(default_factory=dict)


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="kubernetes",
            factory=None,
            options=KubernetesSchedulerOptions,
            description="Kubernetes JobSet / Indexed Job",
            requires=("kubernetes",),
            extra="kubernetes",
            implemented=False,
        )
    ]
