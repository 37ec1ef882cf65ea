"""A Kubernetes cluster for tests, on this machine: kmock's API-server emulator on
127.0.0.1 (:class:`KMockServer`), and :class:`FakeKubelet`, which plays the JobSet
controller and the kubelet for it by running each pod's container command as a local
process. kmock stores objects and streams watch events but runs nothing; with the fake
kubelet a JobSet the ``kubernetes`` scheduler creates really runs, so the scheduler kit
can check it end to end. Import after ``pytest.importorskip("kmock")``."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import yaml
from kubernetes import client

from .timing import scaled

log = logging.getLogger(__name__)

JOBSET = ("jobset.x-k8s.io", "v1alpha2")
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"


class KMockServer:
    """kmock's emulator (asyncio) on its own thread, for a synchronous client."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            # Known before any object exists, so that listing an empty kind answers [].
            for res in ("v1/pods", "v1/configmaps", "v1/services", "batch/v1/jobs",
                        "jobset.x-k8s.io/v1alpha2/jobsets"):
                emulator.resources[res] = {}
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> KMockServer:
        self._thread.start()
        assert self._ready.wait(scaled(30)), f"kmock did not start in {scaled(30):g} s"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(scaled(10))

    def in_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the emulator's loop (its reactions are not thread-safe)."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def serve_log(self, pod: str, text: str, namespace: str = "rl") -> None:
        self.in_loop(lambda: self.emulator[f"get /api/v1/namespaces/{namespace}/pods/{pod}/log"] << text.encode())

    def client(self) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)


def write_kubeconfig(path: Path, url: str, namespace: str = "rl") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": namespace}}],
    }))
    return path


@dataclass
class Pod:
    name: str
    role: str
    primary: bool
    proc: subprocess.Popen
    log: Path
    exit_code: int | None = None
    stopped: bool = False  # ended by the controller (the job ended, or was deleted)


@dataclass
class Run:
    name: str
    pods: list[Pod] = field(default_factory=list)
    finished: bool = False


class FakeKubelet:
    """Runs the JobSets of ``namespace`` as local processes: one process (group) per pod,
    started with the container's command and environment (the downward-API indices
    resolved); a pod object per rank with the labels and annotations the JobSet and Job
    controllers give theirs; pod status, logs and the JobSet's conditions as its
    ``successPolicy`` (every primary pod exited 0: Completed) and a failurePolicy without
    restarts (a pod exited non-zero: Failed) say, stopping the other pods then. A deleted
    JobSet's processes are killed and its pods deleted (foreground propagation)."""

    def __init__(self, server: KMockServer, namespace: str, log_dir: Path, stop_timeout: float = 10) -> None:
        self.server, self.namespace, self.log_dir, self.stop_timeout = server, namespace, log_dir, stop_timeout
        api = server.client()
        self.custom, self.core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        self.runs: dict[str, Run] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)

    def __enter__(self) -> FakeKubelet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(scaled(30))
        for run in self.runs.values():
            self._stop_pods(run.pods, grace=0)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._tick()
            except Exception as exc:
                log.exception("fake kubelet")
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        items = self.custom.list_namespaced_custom_object(*JOBSET, self.namespace, "jobsets")["items"]
        present = {js["metadata"]["name"] for js in items}
        for js in items:
            if js["metadata"]["name"] not in self.runs:
                self.runs[js["metadata"]["name"]] = self._start(js)
        for name, run in self.runs.items():
            if name not in present and any(p.exit_code is None for p in run.pods):
                self._stop_pods(run.pods, grace=0)  # deleted: the pods go with it
                for pod in run.pods:
                    self._delete_pod(pod)
                run.finished = True
            elif name in present and not run.finished:
                self._advance(run)

    # ------------------------------------------------------------------ pods

    def _start(self, js: dict[str, Any]) -> Run:
        name = js["metadata"]["name"]
        run = Run(name)
        primaries = set(js["spec"].get("successPolicy", {}).get("targetReplicatedJobs") or [])
        # As in a cluster: the Job controller counts a pod as active once it has created it,
        # before its container's process runs (CI once saw a role's process write its record
        # while this fake still reported the JobSet with nothing active: PENDING).
        self._patch_jobset(run, {"replicatedJobsStatus": [
            {"name": rj["name"], "active": rj["replicas"], "ready": rj["replicas"], "succeeded": 0, "failed": 0,
             "suspended": 0} for rj in js["spec"]["replicatedJobs"]]})
        for rj in js["spec"]["replicatedJobs"]:
            job_spec = rj["template"]["spec"]
            template = job_spec["template"]
            container = template["spec"]["containers"][0]
            for replica in range(rj["replicas"]):
                for index in range(job_spec["completions"]):
                    pod_name = f"{name}-{rj['name']}-{replica}-{index}"
                    env = {**os.environ, **_resolve_env(container.get("env", []), replica, index)}
                    path = self.log_dir / f"{pod_name}.log"
                    with open(path, "wb") as out:
                        proc = subprocess.Popen(container["command"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                    primary = not primaries or rj["name"] in primaries
                    run.pods.append(Pod(pod_name, rj["name"], primary, proc, path))
                    self.core.create_namespaced_pod(self.namespace, {
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": pod_name, "namespace": self.namespace,
                                     "labels": dict(template["metadata"]["labels"]),
                                     "annotations": {JOB_INDEX: str(replica), COMPLETION_INDEX: str(index)}},
                        "spec": {"containers": [{"name": container["name"], "image": container["image"]}]},
                        "status": {"phase": "Running"},
                    })
        return run

    def _advance(self, run: Run) -> None:
        for pod in run.pods:
            if pod.exit_code is None and pod.proc.poll() is not None:
                self._ended(pod, _exit_code(pod.proc.returncode))
        failed = [p for p in run.pods if p.exit_code not in (None, 0) and not p.stopped]
        primaries = [p for p in run.pods if p.primary]
        if failed:
            condition = {"type": "Failed", "status": "True", "reason": "FailedJobs",
                         "message": "jobset failed due to one or more job failures"}
        elif all(p.exit_code == 0 for p in primaries):
            condition = {"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                         "message": "jobset completed successfully"}
        else:
            return
        self._stop_pods(run.pods, grace=self.stop_timeout)
        run.finished = True
        self._patch_jobset(run, {"conditions": [condition]})

    def _stop_pods(self, pods: list[Pod], grace: float) -> None:
        """SIGTERM to every running pod's process group, SIGKILL after ``grace`` seconds."""
        running = [p for p in pods if p.exit_code is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pod in running:
                try:
                    os.killpg(pod.proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while any(p.proc.poll() is None for p in running) and time.monotonic() < deadline:
                time.sleep(0.05)
        for pod in running:
            pod.proc.wait()
            pod.stopped = True
            self._ended(pod, _exit_code(pod.proc.returncode))

    def _ended(self, pod: Pod, code: int) -> None:
        pod.exit_code = code
        self.server.serve_log(pod.name, pod.log.read_text(errors="replace"), self.namespace)
        try:
            self.core.patch_namespaced_pod_status(pod.name, self.namespace, {"status": {
                "phase": "Failed" if code else "Succeeded",
                "containerStatuses": [{"name": pod.role, "image": "img", "imageID": "", "ready": False,
                                       "restartCount": 0, "state": {"terminated": {
                                           "exitCode": code, "reason": "Error" if code else "Completed"}}}]}})
        except client.ApiException as exc:
            if exc.status != 404:  # deleted with its JobSet meanwhile
                raise

    def _delete_pod(self, pod: Pod) -> None:
        try:
            self.core.delete_namespaced_pod(pod.name, self.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def _patch_jobset(self, run: Run, status: dict[str, Any]) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(
                *JOBSET, self.namespace, "jobsets", run.name, {"status": status})
        except client.ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                raise


def _resolve_env(entries: list[dict[str, Any]], replica: int, index: int) -> dict[str, str]:
    """A container's env as the kubelet makes it: downward-API indices filled in, and
    ``$(NAME)`` expanded from the variables defined before."""
    env: dict[str, str] = {}
    for entry in entries:
        if "valueFrom" in entry:
            path = entry["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
            value = str(index) if COMPLETION_INDEX in path else str(replica) if JOB_INDEX in path else "0"
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(entry.get("value", "")))
        env[entry["name"]] = value
    return env


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
