"""``kubernetes``: JobSet or Indexed Job manifests via the official client.

Nothing is imported here: the options model is in :mod:`.options`, and the ``kubernetes``
client is imported by :mod:`.scheduler` when the backend is built.
"""

from __future__ import annotations

from forgerl.backends import SchedulerBackend, lazy_options
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


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("KubernetesSchedulerOptions", "Volume", "Toleration", "DNS_LABEL", "QUANTITY"))
