"""The kubernetes scheduler against the kmock API emulator on 127.0.0.1, through the
official client and a kubeconfig file. kmock stores objects and streams watch events but
runs nothing, so each test plays the Job/JobSet controller and the kubelet: it creates the
pods, patches status and serves pod logs."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from forgerl.errors import JobNotFound, UserError
from forgerl.types import JobSpec, JobState, JobStatus, Resources, RoleSpec

kmock = pytest.importorskip("kmock")
kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402 - after the importorskip above

from forgerl_plugins.schedulers.kubernetes.scheduler import (  # noqa: E402
    KubernetesScheduler,
    KubernetesUnreachable,
)
from tests.helpers.kmock_cluster import KMockServer  # noqa: E402
from tests.helpers.kmock_cluster import write_kubeconfig as _kubeconfig  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = pytest.mark.integration

NS = "rl"
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", NS, "jobsets")


@pytest.fixture
def server():
    with KMockServer() as s:
        yield s


@pytest.fixture
def kubeconfig(server, tmp_path) -> Path:
    return _kubeconfig(tmp_path / "kubeconfig", server.url)


@pytest.fixture
def controller(server) -> Any:
    """The test's own client: the controller and kubelet it plays."""
    cfg = client.Configuration()
    cfg.host = server.url
    return client.ApiClient(cfg)


def _scheduler(kubeconfig: Path, **kw) -> KubernetesScheduler:
    opts = KubernetesScheduler.Options(
        namespace=NS, image="ghcr.io/example/forgerl:0.1", kubeconfig=str(kubeconfig), poll_interval=0.5,
        volumes=[{"name": "runs", "pvc": "forge-runs", "mount_path": "/runs"}], **kw)
    return KubernetesScheduler(opts)


def _job(name: str = "grpo-1") -> JobSpec:
    return JobSpec(name=name, run_dir=f"/runs/{name}", roles=(
        RoleSpec(name="generator", command=("python", "-m", "server"), resources=Resources(cpus=2)),
        RoleSpec(name="trainer", command=("python", "-m", "train"), primary=True, ranks_per_replica=2),
    ))


def _pod(controller, name: str, role: str, replica: int, rank: int, primary: bool, run: str = "grpo-1",
         exit_code: int | None = None) -> None:
    """What the Job controller and kubelet would make: a pod with the template's labels."""
    status: dict[str, Any] = {"phase": "Running"}
    if exit_code is not None:
        status = {"phase": "Failed" if exit_code else "Succeeded", "containerStatuses": [{
            "name": role, "image": "img", "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}}}]}
    client.CoreV1Api(controller).create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"forgerl.dev/job": run, "forgerl.dev/role": role,
                                "forgerl.dev/primary": str(primary).lower()},
                     "annotations": {"jobset.sigs.k8s.io/job-index": str(replica),
                                     "batch.kubernetes.io/job-completion-index": str(rank)}},
        "spec": {"containers": [{"name": role, "image": "img"}]},
        "status": status,
    })


def _in_background(fn: Callable[[], JobStatus]) -> Future:
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut


def test_jobset_submit_watch_complete_and_logs(server, kubeconfig, controller):
    sched = _scheduler(kubeconfig)
    handle = sched.submit(_job())
    assert (handle.scheduler, handle.job_id) == ("kubernetes", "grpo-1")

    custom = client.CustomObjectsApi(controller)
    jobset = custom.get_namespaced_custom_object(*JOBSETS, "grpo-1")
    assert [rj["name"] for rj in jobset["spec"]["replicatedJobs"]] == ["generator", "trainer"]
    cm = client.CoreV1Api(controller).read_namespaced_config_map("grpo-1-config", NS)
    assert yaml.safe_load(cm.data["job.yaml"])["name"] == "grpo-1"
    assert sched.status("grpo-1").state is JobState.PENDING

    waiting = _in_background(lambda: sched.wait(handle, timeout=scaled(60)))
    _pod(controller, "grpo-1-generator-0-0", "generator", 0, 0, primary=False)
    for rank in (0, 1):
        _pod(controller, f"grpo-1-trainer-0-{rank}", "trainer", 0, rank, primary=True)
    custom.patch_namespaced_custom_object_status(*JOBSETS, "grpo-1", {"status": {
        "replicatedJobsStatus": [{"name": "trainer", "active": 1, "ready": 1, "succeeded": 0, "failed": 0,
                                  "suspended": 0}]}})
    assert not waiting.done()
    assert sched.status("grpo-1").state is JobState.RUNNING
    custom.patch_namespaced_custom_object_status(*JOBSETS, "grpo-1", {"status": {
        "conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                        "message": "jobset completed successfully"}]}})
    status = waiting.result(timeout=scaled(30))
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status

    server.serve_log("grpo-1-trainer-0-0", "step 1\nstep 2\n")
    server.serve_log("grpo-1-trainer-0-1", "rank 1 ready\n")
    server.serve_log("grpo-1-generator-0-0", "serving\n")
    assert list(sched.logs("grpo-1", role="trainer")) == [
        "[grpo-1-trainer-0-0] step 1", "[grpo-1-trainer-0-0] step 2", "[grpo-1-trainer-0-1] rank 1 ready"]
    assert list(sched.logs("grpo-1")) == [
        "[grpo-1-generator-0-0] serving", "[grpo-1-trainer-0-0] step 1", "[grpo-1-trainer-0-0] step 2",
        "[grpo-1-trainer-0-1] rank 1 ready"]


def test_jobset_failure_reports_the_primary_exit_code(server, kubeconfig, controller):
    sched = _scheduler(kubeconfig)
    handle = sched.submit(_job())
    _pod(controller, "grpo-1-generator-0-0", "generator", 0, 0, primary=False)
    _pod(controller, "grpo-1-trainer-0-0", "trainer", 0, 0, primary=True, exit_code=0)
    _pod(controller, "grpo-1-trainer-0-1", "trainer", 0, 1, primary=True, exit_code=3)
    client.CustomObjectsApi(controller).patch_namespaced_custom_object_status(*JOBSETS, "grpo-1", {"status": {
        "conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs",
                        "message": "jobset failed due to one or more job failures"}]}})
    status = sched.wait(handle, timeout=scaled(30))
    assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    assert "job failures" in status.detail


def test_indexed_jobs_complete_and_the_servers_are_stopped(server, kubeconfig, controller):
    sched = _scheduler(kubeconfig, use_jobset=False)
    handle = sched.submit(_job())
    batch = client.BatchV1Api(controller)
    names = sorted(j.metadata.name for j in batch.list_namespaced_job(NS).items)
    assert names == ["grpo-1-generator-0", "grpo-1-trainer-0"]
    svc = client.CoreV1Api(controller).read_namespaced_service("grpo-1", NS)
    assert svc.spec.cluster_ip == "None"

    waiting = _in_background(lambda: sched.wait(handle, timeout=scaled(60)))
    batch.patch_namespaced_job_status("grpo-1-generator-0", NS, {"status": {"active": 1, "ready": 1}})
    batch.patch_namespaced_job_status("grpo-1-trainer-0", NS, {"status": {"active": 2}})
    assert sched.status("grpo-1").state is JobState.RUNNING
    batch.patch_namespaced_job_status("grpo-1-trainer-0", NS, {"status": {
        "active": 0, "succeeded": 2,
        "conditions": [{"type": "Complete", "status": "True"}]}})
    status = waiting.result(timeout=scaled(30))
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0), status
    # Nothing in the cluster would stop the generator without JobSet: wait() did.
    assert [j.metadata.name for j in batch.list_namespaced_job(NS).items] == ["grpo-1-trainer-0"]


def test_cancel_deletes_the_run(server, kubeconfig, controller):
    for use_jobset in (True, False):
        sched = _scheduler(kubeconfig, use_jobset=use_jobset)
        sched.submit(_job("run-a"))
        sched.cancel(f"{NS}/run-a")
        core = client.CoreV1Api(controller)
        assert [c.metadata.name for c in core.list_namespaced_config_map(NS).items] == []
        assert client.BatchV1Api(controller).list_namespaced_job(NS).items == []
        assert client.CustomObjectsApi(controller).list_namespaced_custom_object(*JOBSETS)["items"] == []
        assert core.list_namespaced_service(NS).items == []
        with pytest.raises(JobNotFound):
            sched.status("run-a")
        with pytest.raises(JobNotFound):
            sched.cancel("run-a")


def test_a_second_run_with_the_same_name_is_refused_and_nothing_is_left_half_made(server, kubeconfig, controller):
    sched = _scheduler(kubeconfig)
    sched.submit(_job())
    with pytest.raises(UserError, match="already exists"):
        sched.submit(_job())
    # A cluster without the JobSet API: the ConfigMap made before it is removed again.
    server.in_loop(lambda: server.emulator[f"post /apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"] << 404)
    with pytest.raises(UserError, match="use_jobset=false") as err:
        sched.submit(_job("run-b"))
    assert "\n" not in str(err.value)
    cms = [c.metadata.name for c in client.CoreV1Api(controller).list_namespaced_config_map(NS).items]
    assert cms == ["grpo-1-config"], cms


def test_missing_kubeconfig_is_a_one_line_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    sched = KubernetesScheduler(KubernetesScheduler.Options(namespace=NS))
    with pytest.raises(UserError, match="no kubeconfig") as err:
        sched.status("grpo-1")
    assert "\n" not in str(err.value)
    sched = KubernetesScheduler(KubernetesScheduler.Options(namespace=NS, kubeconfig=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="does not exist"):
        sched.status("grpo-1")


def test_unreachable_api_server(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sched = _scheduler(_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}"))
    sched.api.client.configuration.retries = 0
    with pytest.raises(KubernetesUnreachable, match="did not answer") as err:
        sched.status("grpo-1")
    assert "\n" not in str(err.value)
