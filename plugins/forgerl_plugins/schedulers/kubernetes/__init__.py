"""``kubernetes``: JobSet or Indexed Job manifests via the official client.

The backend is :class:`.scheduler.KubernetesScheduler`, its options nested in it; the
``kubernetes`` client is imported only when the scheduler talks to a cluster.
"""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_schedulers():
    return ["forgerl_plugins.schedulers.kubernetes.scheduler:KubernetesScheduler"]
