"""The Kubernetes API as the scheduler uses it: one namespace, the run's objects found by
label, every failure turned into a one-line error. The ``kubernetes`` client is imported
only here, and only when a call is made."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forgerl.errors import BackendUnavailable, SchedulerError, UserError
from forgerl_plugins.schedulers.kubernetes.manifests import (
    ANNOTATION_MODE,
    JOBSET_API,
    LABEL_JOB,
    config_map_name,
)
from forgerl_plugins.schedulers.kubernetes.status import labels

JOBSET_GROUP, JOBSET_VERSION = JOBSET_API.split("/")


class KubernetesUnreachable(SchedulerError, UserError):
    """The Kubernetes API server did not answer."""


def kube():
    """The official client's ``client`` and ``config`` modules, or BackendUnavailable."""
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        raise BackendUnavailable(
            "the kubernetes scheduler needs the kubernetes client: pip install 'forgerl[kubernetes]'"
        ) from None
    from kubernetes import client, config

    return client, config


def api_client(kubeconfig: str | None, context: str | None):
    """An ApiClient from ``kubeconfig``, $KUBECONFIG, ~/.kube/config or the in-cluster
    service account, in that order; a one-line UserError when there is none."""
    client, config = kube()
    path = kubeconfig or (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or None
    default = Path.home() / ".kube" / "config"
    if path is None and default.is_file():
        path = str(default)
    try:
        if path is not None:
            if not Path(path).expanduser().is_file():
                raise UserError(f"kubeconfig {path} does not exist: set scheduler.options.kubeconfig or KUBECONFIG")
            return config.new_client_from_config(config_file=str(Path(path).expanduser()), context=context)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
    except config.ConfigException as exc:
        raise UserError(f"cannot use kubeconfig {path or '(in-cluster)'}: {' '.join(str(exc).split())}") from None
    raise UserError(
        "no kubeconfig: set scheduler.options.kubeconfig or KUBECONFIG, create ~/.kube/config, "
        "or run forge inside the cluster"
    )


class KubeApi:
    """The calls the scheduler makes, in one namespace. The ApiClient is made on first use,
    so rendering manifests needs no cluster."""

    def __init__(self, namespace: str, kubeconfig: str | None, context: str | None):
        self.namespace = namespace
        self._kubeconfig, self._context = kubeconfig, context
        self._api: Any = None

    @property
    def client(self) -> Any:
        if self._api is None:
            self._api = api_client(self._kubeconfig, self._context)
        return self._api

    def create(self, obj: dict[str, Any]) -> None:
        client, _ = kube()
        ns, kind, api = self.namespace, obj["kind"], self.client
        creators = {
            "ConfigMap": lambda: client.CoreV1Api(api).create_namespaced_config_map(ns, obj),
            "Service": lambda: client.CoreV1Api(api).create_namespaced_service(ns, obj),
            "Job": lambda: client.BatchV1Api(api).create_namespaced_job(ns, obj),
            "JobSet": lambda: client.CustomObjectsApi(api).create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", obj),
        }
        self.call(f"create {kind} {obj['metadata']['name']}", creators[kind])

    def jobset(self, name: str) -> dict[str, Any] | None:
        """The JobSet ``name`` as a dict, None when there is none."""
        client, _ = kube()
        return self.call(f"read JobSet {name}", lambda: client.CustomObjectsApi(self.client)
                         .get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.namespace,
                                                       "jobsets", name), missing=None)

    def lister(self, mode: str) -> tuple[Callable[..., Any], tuple]:
        """The list call (and its arguments) a watch of the run's JobSets or Jobs streams."""
        client, _ = kube()
        if mode == "jobset":
            return (client.CustomObjectsApi(self.client).list_namespaced_custom_object,
                    (JOBSET_GROUP, JOBSET_VERSION, self.namespace, "jobsets"))
        return client.BatchV1Api(self.client).list_namespaced_job, (self.namespace,)

    def recorded_mode(self, name: str) -> str | None:
        """"jobset" or "jobs" as the run's ConfigMap records it; None when it is gone."""
        client, _ = kube()
        cm = self.call(f"read ConfigMap {config_map_name(name)}", lambda: client.CoreV1Api(self.client)
                       .read_namespaced_config_map(config_map_name(name), self.namespace), missing=None)
        return ((cm.metadata.annotations or {}) if cm is not None else {}).get(ANNOTATION_MODE)

    def owned(self, kind: str, name: str) -> list[dict[str, Any]]:
        """The run's objects of ``kind`` as dicts. The label selector is also checked here:
        an API server (or an emulator) that ignores it must not make us touch other runs."""
        client, _ = kube()
        api = self.client
        selector = f"{LABEL_JOB}={name}"
        if kind == "Job":
            items = self.call("list Jobs", lambda: client.BatchV1Api(api).list_namespaced_job(
                self.namespace, label_selector=selector)).items
        else:
            items = self.call("list Pods", lambda: client.CoreV1Api(api).list_namespaced_pod(
                self.namespace, label_selector=selector)).items
        dicts = [api.sanitize_for_serialization(i) for i in items]
        return [d for d in dicts if labels(d).get(LABEL_JOB) == name]

    def delete_quietly(self, kind: str, obj_name: str) -> bool:
        """Delete with foreground propagation (the Jobs' pods go too); False if absent."""
        client, _ = kube()
        api, ns = self.client, self.namespace
        prop = "Foreground"
        calls = {
            "JobSet": lambda: client.CustomObjectsApi(api).delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", obj_name, propagation_policy=prop),
            "Job": lambda: client.BatchV1Api(api).delete_namespaced_job(obj_name, ns, propagation_policy=prop),
            "Service": lambda: client.CoreV1Api(api).delete_namespaced_service(obj_name, ns),
            "ConfigMap": lambda: client.CoreV1Api(api).delete_namespaced_config_map(obj_name, ns),
        }
        return self.call(f"delete {kind} {obj_name}", calls[kind], missing=False) is not False

    def call(self, what: str, fn: Callable[[], Any], missing: Any = ...) -> Any:
        """Run one API call; 404 → ``missing`` when given; other failures → one-line errors."""
        client, _ = kube()
        try:
            return fn()
        except client.ApiException as exc:
            if exc.status == 404 and missing is not ...:
                return missing
            raise self._api_error(what, exc) from None
        except (UserError, SchedulerError):
            raise
        except Exception as exc:  # urllib3 connection errors and the like
            if type(exc).__module__.startswith(("urllib3", "requests", "socket")) or isinstance(exc, OSError):
                host = getattr(getattr(self._api, "configuration", None), "host", "?")
                raise KubernetesUnreachable(
                    f"the Kubernetes API server at {host} did not answer ({type(exc).__name__}); check the "
                    "kubeconfig and that the cluster is up"
                ) from None
            raise

    def _api_error(self, what: str, exc: Any) -> Exception:
        reason = _status_message(exc)
        if exc.status == 404 and "JobSet" in what and what.startswith("create"):
            return UserError(
                "the cluster has no JobSet API (jobset.x-k8s.io): install JobSet "
                "(https://jobset.sigs.k8s.io) or set scheduler.options.use_jobset=false"
            )
        if exc.status == 409:
            return UserError(f"{what}: it already exists in namespace {self.namespace}; "
                             "`forge cancel NAME` or choose another run name")
        if exc.status in (401, 403):
            return UserError(f"{what}: not allowed ({reason}); check the kubeconfig's user and RBAC")
        if exc.status in (400, 422):
            return UserError(f"{what}: the API server refused it: {reason}")
        return SchedulerError(f"{what}: HTTP {exc.status}: {reason}")


def _status_message(exc: Any) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return " ".join(str(body.get("message") or exc.reason).split())
    except (ValueError, AttributeError):
        return str(exc.reason)
