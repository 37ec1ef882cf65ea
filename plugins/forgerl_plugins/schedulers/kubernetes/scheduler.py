"""The ``kubernetes`` scheduler: creates the manifests of :mod:`.manifests` through
:class:`.api.KubeApi`, watches them (their state read by :mod:`.status`), reads pod logs,
deletes them.

A job id is the run's Kubernetes name (``NAME`` or ``NAMESPACE/NAME``). Everything the
run created carries the label ``forgerl.dev/job=NAME``; the ConfigMap records whether it
is a JobSet or Indexed Jobs, so ``forge status`` needs no local state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial
from typing import Any, TypeAlias

from forgerl.errors import ConfigError, JobNotFound, SchedulerError
from forgerl.interfaces import Scheduler
from forgerl.types import JobHandle, JobSpec, JobStatus
from forgerl_plugins.schedulers.kubernetes.api import KubeApi, KubernetesUnreachable, api_client, kube
from forgerl_plugins.schedulers.kubernetes.manifests import (
    LABEL_JOB,
    LABEL_ROLE,
    config_map_name,
    dns_name,
    render_objects,
    render_yaml,
)
from forgerl_plugins.schedulers.kubernetes.options import Options as _Options
from forgerl_plugins.schedulers.kubernetes.status import (
    job_state,
    jobs_status,
    jobset_status,
    labels,
    pod_order,
    primary_exit_code,
)

__all__ = ["KubernetesScheduler", "KubernetesUnreachable"]

log = logging.getLogger("forgerl.scheduler.kubernetes")


class KubernetesScheduler(Scheduler):
    name = "kubernetes"
    description = "Kubernetes JobSet / Indexed Job"
    requires = ("kubernetes",)
    extra = "kubernetes"

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    detached = True
    shares_filesystem = False  # task files and models live in the pods' volumes
    supports_logs = True

    def __init__(self, options: Options | None = None):
        self.options = options or KubernetesScheduler.Options()
        self.api = KubeApi(self.options.namespace, self.options.kubeconfig, self.options.context)

    # ------------------------------------------------------------------ submit

    def render(self, job: JobSpec) -> str:
        return render_yaml(job, self.options)

    def submit(self, job: JobSpec) -> JobHandle:
        objects = render_objects(job, self.options)  # bad input fails before any API call
        name = objects[0]["metadata"]["labels"][LABEL_JOB]
        created: list[dict[str, Any]] = []
        try:
            for obj in objects:
                self.api.create(obj)
                created.append(obj)
        except BaseException:
            # All or nothing: a half-created run would hold a name and resources.
            for obj in reversed(created):
                self.api.delete_quietly(obj["kind"], obj["metadata"]["name"])
            raise
        log.info("created %s in namespace %s", ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects),
                 self.options.namespace)
        return JobHandle(scheduler="kubernetes", job_id=name, run_dir=job.run_dir)

    # ------------------------------------------------------------------- watch

    def status(self, job_id: str) -> JobStatus:
        return self._observe(self._name(job_id), self._mode(self._name(job_id)))[0]

    def _observe(self, name: str, mode: str) -> tuple[JobStatus, dict[str, Any]]:
        """The run's status, and the status block of each object it was read from (what
        a watch compares events against)."""
        exit_code = partial(self._primary_exit_code, name)
        if mode == "jobset":
            js = self.api.jobset(name)
            if js is None:
                raise JobNotFound(f"no JobSet {name} in namespace {self.options.namespace}")
            return jobset_status(js, exit_code), {name: js.get("status")}
        jobs = self.api.owned("Job", name)
        if not jobs:
            raise JobNotFound(f"no Jobs of run {name} in namespace {self.options.namespace}")
        return jobs_status(jobs, exit_code), {j["metadata"]["name"]: j.get("status") for j in jobs}

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
        kube()
        from kubernetes import watch

        lister, args = self.api.lister(mode)
        w = watch.Watch()
        start = time.monotonic()
        try:
            for event in w.stream(lister, *args, label_selector=f"{LABEL_JOB}={name}",
                                  timeout_seconds=max(1, int(seconds)), _request_timeout=int(seconds) + 2):
                obj = event.get("object")
                obj = obj if isinstance(obj, dict) else self.api.client.sanitize_for_serialization(obj)
                if labels(obj).get(LABEL_JOB) == name:
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
            if not self.api.delete_quietly("JobSet", name):
                raise JobNotFound(f"no JobSet {name} in namespace {self.options.namespace}")
        else:
            if not self._delete_jobs(name, only_running=False):
                raise JobNotFound(f"no Jobs of run {name} in namespace {self.options.namespace}")
            self.api.delete_quietly("Service", name)
        self.api.delete_quietly("ConfigMap", config_map_name(name))
        log.info("deleted run %s", name)

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        client, _ = kube()
        name = self._name(job_id)
        core = client.CoreV1Api(self.api.client)
        pods = self.api.owned("Pod", name)
        if role is not None:
            rname = dns_name(role, "role name")
            pods = [p for p in pods if labels(p).get(LABEL_ROLE) == rname]
            if not pods:
                raise JobNotFound(f"run {name} has no pods of role {role!r}")
        elif not pods and self.api.recorded_mode(name) is None:
            raise JobNotFound(f"no run {name} in namespace {self.options.namespace}")
        pods.sort(key=pod_order)
        prefix = role is None or len(pods) > 1
        for pod in pods:
            pname = pod["metadata"]["name"]
            resp = self.api.call(f"read log of pod {pname}", partial(
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
        api_client(self.options.kubeconfig, self.options.context)

    def _name(self, job_id: str) -> str:
        ns, sep, name = str(job_id).strip().rpartition("/")
        if sep and ns != self.options.namespace:
            raise ConfigError(
                f"job {job_id} is in namespace {ns}, but scheduler.options.namespace is {self.options.namespace}"
            )
        return dns_name(name, "job id")

    def _mode(self, name: str) -> str:
        """"jobset" or "jobs" from the run's ConfigMap; the options' choice when it is gone."""
        return self.api.recorded_mode(name) or ("jobset" if self.options.use_jobset else "jobs")

    def _primary_exit_code(self, name: str) -> int | None:
        try:
            return primary_exit_code(self.api.owned("Pod", name))
        except SchedulerError:
            return None

    def _delete_jobs(self, name: str, only_running: bool) -> int:
        """Delete the run's Jobs (only the unfinished ones when ``only_running``); returns
        how many Jobs the run has."""
        jobs = self.api.owned("Job", name)
        for job in jobs:
            if not (only_running and job_state(job).finished):
                self.api.delete_quietly("Job", job["metadata"]["name"])
        return len(jobs)
