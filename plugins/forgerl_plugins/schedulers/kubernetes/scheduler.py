"""The ``kubernetes`` scheduler: creates the manifests of :mod:`.manifests` with the
official client, watches them, reads pod logs, deletes them.

A job id is the run's Kubernetes name (``NAME`` or ``NAMESPACE/NAME``). Everything the
run created carries the label ``forgerl.dev/job=NAME``; the ConfigMap records whether it
is a JobSet or Indexed Jobs, so ``forge status`` needs no local state.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from forgerl.errors import BackendUnavailable, ConfigError, JobNotFound, SchedulerError, UserError
from forgerl.interfaces import Scheduler
from forgerl.options import OptionsModel
from forgerl.types import JobHandle, JobSpec, JobState, JobStatus
from forgerl_plugins.schedulers.kubernetes.manifests import (
    ANNOTATION_MODE,
    DNS_LABEL,
    JOBSET_API,
    LABEL_JOB,
    LABEL_PRIMARY,
    LABEL_REPLICA,
    LABEL_ROLE,
    QUANTITY,
    config_map_name,
    dns_name,
    render_objects,
    render_yaml,
)

log = logging.getLogger("forgerl.scheduler.kubernetes")

JOBSET_GROUP, JOBSET_VERSION = JOBSET_API.split("/")


class KubernetesUnreachable(SchedulerError, UserError):
    """The Kubernetes API server did not answer."""


def _kube():
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        raise BackendUnavailable(
            "the kubernetes scheduler needs the kubernetes client: pip install 'forgerl[kubernetes]'"
        ) from None
    from kubernetes import client, config

    return client, config


def api_client(opts: KubernetesScheduler.Options):
    """An ApiClient from options.kubeconfig, $KUBECONFIG, ~/.kube/config or the in-cluster
    service account, in that order; a one-line UserError when there is none."""
    client, config = _kube()
    path = opts.kubeconfig or (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or None
    default = Path.home() / ".kube" / "config"
    if path is None and default.is_file():
        path = str(default)
    try:
        if path is not None:
            if not Path(path).expanduser().is_file():
                raise UserError(f"kubeconfig {path} does not exist: set scheduler.options.kubeconfig or KUBECONFIG")
            return config.new_client_from_config(config_file=str(Path(path).expanduser()), context=opts.context)
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


class KubernetesScheduler(Scheduler):
    name = "kubernetes"
    description = "Kubernetes JobSet / Indexed Job"
    requires = ("kubernetes",)
    extra = "kubernetes"

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
        def _unique_volumes(self) -> KubernetesScheduler.Options:
            names = [v.name for v in self.volumes]
            if len(set(names)) != len(names):
                raise ValueError(f"volume names must be unique, got {names}")
            return self

    detached = True
    shares_filesystem = False  # task files and models live in the pods' volumes
    supports_logs = True

    def __init__(self, options: Options | None = None):
        self.options = options or KubernetesScheduler.Options()
        self._api = None

    # ------------------------------------------------------------------ submit

    def render(self, job: JobSpec) -> str:
        return render_yaml(job, self.options)

    def submit(self, job: JobSpec) -> JobHandle:
        objects = render_objects(job, self.options)  # bad input fails before any API call
        name = objects[0]["metadata"]["labels"][LABEL_JOB]
        created: list[dict[str, Any]] = []
        try:
            for obj in objects:
                self._call(f"create {obj['kind']} {obj['metadata']['name']}", partial(self._create, obj))
                created.append(obj)
        except BaseException:
            # All or nothing: a half-created run would hold a name and resources.
            for obj in reversed(created):
                self._delete_quietly(obj["kind"], obj["metadata"]["name"])
            raise
        log.info("created %s in namespace %s", ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects),
                 self.options.namespace)
        return JobHandle(scheduler="kubernetes", job_id=name, run_dir=job.run_dir)

    def _create(self, obj: dict[str, Any]) -> None:
        client, _ = _kube()
        ns, kind = self.options.namespace, obj["kind"]
        api = self._client()
        if kind == "ConfigMap":
            client.CoreV1Api(api).create_namespaced_config_map(ns, obj)
        elif kind == "Service":
            client.CoreV1Api(api).create_namespaced_service(ns, obj)
        elif kind == "Job":
            client.BatchV1Api(api).create_namespaced_job(ns, obj)
        elif kind == "JobSet":
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", obj)
        else:  # pragma: no cover - render_objects makes only these
            raise AssertionError(kind)

    # ------------------------------------------------------------------- watch

    def status(self, job_id: str) -> JobStatus:
        return self._observe(self._name(job_id), self._mode(self._name(job_id)))[0]

    def _observe(self, name: str, mode: str) -> tuple[JobStatus, dict[str, Any]]:
        """The run's status, and the status block of each object it was read from (what
        a watch compares events against)."""
        if mode == "jobset":
            client, _ = _kube()
            js = self._call(f"read JobSet {name}", lambda: client.CustomObjectsApi(self._client())
                            .get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.options.namespace,
                                                          "jobsets", name), missing=None)
            if js is None:
                raise JobNotFound(f"no JobSet {name} in namespace {self.options.namespace}")
            return self._jobset_status(name, js), {name: js.get("status")}
        jobs = self._owned("Job", name)
        if not jobs:
            raise JobNotFound(f"no Jobs of run {name} in namespace {self.options.namespace}")
        return self._jobs_status(name, jobs), {j["metadata"]["name"]: j.get("status") for j in jobs}

    def _jobset_status(self, name: str, js: dict[str, Any]) -> JobStatus:
        st = js.get("status") or {}
        conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
        if "Completed" in conds:
            return JobStatus(JobState.COMPLETED, 0, conds["Completed"].get("message") or "Completed")
        if "Failed" in conds:
            return JobStatus(JobState.FAILED, self._primary_exit_code(name),
                             conds["Failed"].get("message") or conds["Failed"].get("reason") or "Failed")
        if "Suspended" in conds:
            return JobStatus(JobState.PENDING, None, "suspended")
        jobs = st.get("replicatedJobsStatus") or []
        active = sum(int(j.get("active") or 0) + int(j.get("ready") or 0) for j in jobs)
        restarts = int(st.get("restarts") or 0)
        detail = f"restarted {restarts}x" if restarts else ""
        return JobStatus(JobState.RUNNING if active else JobState.PENDING, None, detail)

    def _jobs_status(self, name: str, jobs: list[dict[str, Any]]) -> JobStatus:
        primaries = [j for j in jobs if _labels(j).get(LABEL_PRIMARY) == "true"] or jobs
        states = [_job_state(j) for j in primaries]
        if any(s is JobState.FAILED for s in states):
            failed = next(j for j, s in zip(primaries, states) if s is JobState.FAILED)
            return JobStatus(JobState.FAILED, self._primary_exit_code(name),
                             f"Job {failed['metadata']['name']} failed")
        if all(s is JobState.COMPLETED for s in states):
            return JobStatus(JobState.COMPLETED, 0, "primary Jobs complete")
        running = any(_job_state(j) is JobState.RUNNING for j in jobs)
        return JobStatus(JobState.RUNNING if running else JobState.PENDING, None, "")

    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        name = self._name(handle.job_id)
        mode = self._mode(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            st, seen = self._observe(name, mode)
            if (st.state, st.detail) != last:
                log.info("Kubernetes run %s: %s%s", name, st.state.value, f" ({st.detail})" if st.detail else "")
                last = (st.state, st.detail)
            if st.state.finished:
                if mode == "jobs":
                    # Without JobSet nothing in the cluster ends the servers when the
                    # trainer finishes: do it here.
                    self._delete_jobs(name, only_running=True)
                return st
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SchedulerError(f"Kubernetes run {name} still {st.state.value} after {timeout:g}s")
            self._watch_once(name, mode, seen, self.options.poll_interval if left is None
                             else min(self.options.poll_interval, left))

    def _watch_once(self, name: str, mode: str, seen: dict[str, Any], seconds: float) -> None:
        """Block until one of the run's objects differs from ``seen`` (name → status), or
        ``seconds`` pass. A watch starts by replaying every object as ADDED: those count
        only when they differ, so a change made just before the watch began is not missed."""
        client, _ = _kube()
        from kubernetes import watch

        api = self._client()
        if mode == "jobset":
            lister: Callable[..., Any] = client.CustomObjectsApi(api).list_namespaced_custom_object
            args: tuple = (JOBSET_GROUP, JOBSET_VERSION, self.options.namespace, "jobsets")
        else:
            lister = client.BatchV1Api(api).list_namespaced_job
            args = (self.options.namespace,)
        w = watch.Watch()
        start = time.monotonic()
        try:
            for event in w.stream(lister, *args, label_selector=f"{LABEL_JOB}={name}",
                                  timeout_seconds=max(1, int(seconds)), _request_timeout=int(seconds) + 2):
                obj = event.get("object")
                obj = obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj)
                if _labels(obj).get(LABEL_JOB) == name:
                    obj_name = obj.get("metadata", {}).get("name")
                    if event.get("type") != "ADDED" or seen.get(obj_name, ...) != obj.get("status"):
                        break
                if time.monotonic() - start >= seconds:
                    break
        except Exception as exc:  # noqa: BLE001 - a broken watch only costs promptness: poll instead
            log.debug("watch of %s failed (%s); polling", name, exc)
            time.sleep(min(seconds, 1.0))
        finally:
            w.stop()

    def cancel(self, job_id: str) -> None:
        name = self._name(job_id)
        mode = self._mode(name)
        if mode == "jobset":
            if not self._delete_quietly("JobSet", name):
                raise JobNotFound(f"no JobSet {name} in namespace {self.options.namespace}")
        else:
            if not self._delete_jobs(name, only_running=False):
                raise JobNotFound(f"no Jobs of run {name} in namespace {self.options.namespace}")
            self._delete_quietly("Service", name)
        self._delete_quietly("ConfigMap", config_map_name(name))
        log.info("deleted run %s", name)

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        client, _ = _kube()
        name = self._name(job_id)
        core = client.CoreV1Api(self._client())
        pods = self._owned("Pod", name)
        if role is not None:
            rname = dns_name(role, "role name")
            pods = [p for p in pods if _labels(p).get(LABEL_ROLE) == rname]
            if not pods:
                raise JobNotFound(f"run {name} has no pods of role {role!r}")
        elif not pods and self._recorded_mode(name) is None:
            raise JobNotFound(f"no run {name} in namespace {self.options.namespace}")
        pods.sort(key=_pod_order)
        prefix = role is None or len(pods) > 1
        for pod in pods:
            pname = pod["metadata"]["name"]
            resp = self._call(f"read log of pod {pname}", partial(
                core.read_namespaced_pod_log, pname, self.options.namespace, _preload_content=False), missing=None)
            if resp is None:
                continue
            try:
                pending = b""
                for chunk in resp.stream(64 * 1024):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        text = line.decode(errors="replace")
                        yield f"[{pname}] {text}" if prefix else text
                if pending:
                    text = pending.decode(errors="replace")
                    yield f"[{pname}] {text}" if prefix else text
            finally:
                resp.release_conn()

    # ----------------------------------------------------------------- helpers

    def check(self) -> None:
        api_client(self.options)

    def _client(self):
        if self._api is None:
            self._api = api_client(self.options)
        return self._api

    def _name(self, job_id: str) -> str:
        ns, sep, name = str(job_id).strip().rpartition("/")
        if sep and ns != self.options.namespace:
            raise ConfigError(
                f"job {job_id} is in namespace {ns}, but scheduler.options.namespace is {self.options.namespace}"
            )
        return dns_name(name, "job id")

    def _mode(self, name: str) -> str:
        """"jobset" or "jobs" from the run's ConfigMap; the options' choice when it is gone."""
        return self._recorded_mode(name) or ("jobset" if self.options.use_jobset else "jobs")

    def _recorded_mode(self, name: str) -> str | None:
        client, _ = _kube()
        cm = self._call(f"read ConfigMap {config_map_name(name)}", lambda: client.CoreV1Api(self._client())
                        .read_namespaced_config_map(config_map_name(name), self.options.namespace), missing=None)
        return ((cm.metadata.annotations or {}) if cm is not None else {}).get(ANNOTATION_MODE)

    def _owned(self, kind: str, name: str) -> list[dict[str, Any]]:
        """The run's objects of ``kind`` as dicts. The label selector is also checked here:
        an API server (or an emulator) that ignores it must not make us touch other runs."""
        client, _ = _kube()
        api = self._client()
        selector = f"{LABEL_JOB}={name}"
        if kind == "Job":
            items = self._call("list Jobs", lambda: client.BatchV1Api(api).list_namespaced_job(
                self.options.namespace, label_selector=selector)).items
        else:
            items = self._call("list Pods", lambda: client.CoreV1Api(api).list_namespaced_pod(
                self.options.namespace, label_selector=selector)).items
        dicts = [api.sanitize_for_serialization(i) for i in items]
        return [d for d in dicts if _labels(d).get(LABEL_JOB) == name]

    def _primary_exit_code(self, name: str) -> int | None:
        """The first non-zero exit code among the primary role's containers."""
        try:
            pods = self._owned("Pod", name)
        except SchedulerError:
            return None
        primary = [p for p in pods if _labels(p).get(LABEL_PRIMARY) == "true"] or pods
        for pod in sorted(primary, key=_pod_order):
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                term = (cs.get("state") or {}).get("terminated") or {}
                if term.get("exitCode"):
                    return int(term["exitCode"])
        return None

    def _delete_jobs(self, name: str, only_running: bool) -> int:
        """Delete the run's Jobs (only the unfinished ones when ``only_running``); returns
        how many Jobs the run has."""
        jobs = self._owned("Job", name)
        for job in jobs:
            if not (only_running and _job_state(job).finished):
                self._delete_quietly("Job", job["metadata"]["name"])
        return len(jobs)

    def _delete_quietly(self, kind: str, obj_name: str) -> bool:
        """Delete with foreground propagation (the Jobs' pods go too); False if absent."""
        client, _ = _kube()
        api, ns = self._client(), self.options.namespace
        prop = "Foreground"
        calls = {
            "JobSet": lambda: client.CustomObjectsApi(api).delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", obj_name, propagation_policy=prop),
            "Job": lambda: client.BatchV1Api(api).delete_namespaced_job(obj_name, ns, propagation_policy=prop),
            "Service": lambda: client.CoreV1Api(api).delete_namespaced_service(obj_name, ns),
            "ConfigMap": lambda: client.CoreV1Api(api).delete_namespaced_config_map(obj_name, ns),
        }
        return self._call(f"delete {kind} {obj_name}", calls[kind], missing=False) is not False

    def _call(self, what: str, fn: Callable[[], Any], missing: Any = ...) -> Any:
        """Run one API call; 404 → ``missing`` when given; other failures → one-line errors."""
        client, _ = _kube()
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
            return UserError(f"{what}: it already exists in namespace {self.options.namespace}; "
                             "`forge cancel NAME` or choose another run name")
        if exc.status in (401, 403):
            return UserError(f"{what}: not allowed ({reason}); check the kubeconfig's user and RBAC")
        if exc.status in (400, 422):
            return UserError(f"{what}: the API server refused it: {reason}")
        return SchedulerError(f"{what}: HTTP {exc.status}: {reason}")


def _status_message(exc: Any) -> str:
    import json

    try:
        body = json.loads(exc.body or "{}")
        return " ".join(str(body.get("message") or exc.reason).split())
    except (ValueError, AttributeError):
        return str(exc.reason)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _pod_order(pod: dict[str, Any]) -> tuple:
    labels = _labels(pod)
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    replica = labels.get(LABEL_REPLICA) or ann.get("jobset.sigs.k8s.io/job-index") or "0"
    index = ann.get("batch.kubernetes.io/job-completion-index") or "0"
    return (labels.get(LABEL_ROLE, ""), int(replica) if replica.isdigit() else 0,
            int(index) if index.isdigit() else 0, pod["metadata"]["name"])


def _job_state(job: dict[str, Any]) -> JobState:
    st = job.get("status") or {}
    conds = {c.get("type") for c in st.get("conditions") or [] if c.get("status") == "True"}
    if conds & {"Complete", "SuccessCriteriaMet"}:
        return JobState.COMPLETED
    if conds & {"Failed", "FailureTarget"}:
        return JobState.FAILED
    if int(st.get("active") or 0) or int(st.get("ready") or 0):
        return JobState.RUNNING
    return JobState.PENDING
