"""A run's state read from its Kubernetes objects (as dicts): no API calls here, so each
rule can be read and tested on its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forgerl.types import JobState, JobStatus
from forgerl_plugins.schedulers.kubernetes.manifests import LABEL_PRIMARY, LABEL_REPLICA, LABEL_ROLE


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def pod_order(pod: dict[str, Any]) -> tuple:
    """Role, replica, rank, name: the order logs are shown in."""
    lab = labels(pod)
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    replica = lab.get(LABEL_REPLICA) or ann.get("jobset.sigs.k8s.io/job-index") or "0"
    index = ann.get("batch.kubernetes.io/job-completion-index") or "0"
    return (lab.get(LABEL_ROLE, ""), int(replica) if replica.isdigit() else 0,
            int(index) if index.isdigit() else 0, pod["metadata"]["name"])


def job_state(job: dict[str, Any]) -> JobState:
    st = job.get("status") or {}
    conds = {c.get("type") for c in st.get("conditions") or [] if c.get("status") == "True"}
    if conds & {"Complete", "SuccessCriteriaMet"}:
        return JobState.COMPLETED
    if conds & {"Failed", "FailureTarget"}:
        return JobState.FAILED
    if int(st.get("active") or 0) or int(st.get("ready") or 0):
        return JobState.RUNNING
    return JobState.PENDING


def jobset_status(js: dict[str, Any], exit_code: Callable[[], int | None]) -> JobStatus:
    """The run's status from its JobSet; ``exit_code`` is asked only when it failed."""
    st = js.get("status") or {}
    conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    if "Completed" in conds:
        return JobStatus(JobState.COMPLETED, 0, conds["Completed"].get("message") or "Completed")
    if "Failed" in conds:
        return JobStatus(JobState.FAILED, exit_code(),
                         conds["Failed"].get("message") or conds["Failed"].get("reason") or "Failed")
    if "Suspended" in conds:
        return JobStatus(JobState.PENDING, None, "suspended")
    jobs = st.get("replicatedJobsStatus") or []
    active = sum(int(j.get("active") or 0) + int(j.get("ready") or 0) for j in jobs)
    restarts = int(st.get("restarts") or 0)
    detail = f"restarted {restarts}x" if restarts else ""
    return JobStatus(JobState.RUNNING if active else JobState.PENDING, None, detail)


def jobs_status(jobs: list[dict[str, Any]], exit_code: Callable[[], int | None]) -> JobStatus:
    """The run's status from its Indexed Jobs: the primary role's decide how it ended."""
    primaries = [j for j in jobs if labels(j).get(LABEL_PRIMARY) == "true"] or jobs
    states = [job_state(j) for j in primaries]
    if any(s is JobState.FAILED for s in states):
        failed = next(j for j, s in zip(primaries, states) if s is JobState.FAILED)
        return JobStatus(JobState.FAILED, exit_code(), f"Job {failed['metadata']['name']} failed")
    if all(s is JobState.COMPLETED for s in states):
        return JobStatus(JobState.COMPLETED, 0, "primary Jobs complete")
    running = any(job_state(j) is JobState.RUNNING for j in jobs)
    return JobStatus(JobState.RUNNING if running else JobState.PENDING, None, "")


def primary_exit_code(pods: list[dict[str, Any]]) -> int | None:
    """The first non-zero exit code among the primary role's containers."""
    primary = [p for p in pods if labels(p).get(LABEL_PRIMARY) == "true"] or pods
    for pod in sorted(primary, key=pod_order):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode"):
                return int(term["exitCode"])
    return None
