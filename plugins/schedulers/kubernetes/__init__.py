"""``kubernetes``: JobSet or Indexed Job manifests via the official client.

Nothing is imported here: the options model is in :mod:`.options`, and the ``kubernetes``
client is imported by :mod:`.scheduler` when the backend is built.
"""

from __future__ import annotations

from forgerl.backends import SchedulerBackend
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return [
        SchedulerBackend(
            name="kubernetes",
            factory="forgerl_plugins.schedulers.kubernetes.scheduler:KubernetesScheduler",
            options="forgerl_plugins.schedulers.kubernetes.options:KubernetesSchedulerOptions",
            description="Kubernetes JobSet / Indexed Job",
            requires=("kubernetes",),
            extra="kubernetes",
        )
    ]


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name in ("KubernetesSchedulerOptions", "Volume", "Toleration", "DNS_LABEL", "QUANTITY"):
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
