"""JobSpec → Kubernetes manifests (plain dicts; YAML for ``--dry-run``).

One pod per rank. A role replica is an Indexed Job whose completion index is the rank;
with JobSet, a role is one replicated job of ``replicas`` such Jobs. Either way a pod's
DNS name is ``<run>-<role>-<replica>-<rank>.<run>`` (JobSet's headless service, or our
own in Indexed-Job mode), so the rendezvous address of a replica is known before
anything runs: rank 0's name. Pods have their own IPs, so one fixed MASTER_PORT serves.

A replica's resources are per node (as for Slurm); with ``ranks_per_replica / nodes``
ranks per node, each rank's pod gets an even share of them.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from forgerl.errors import ConfigError
from forgerl.types import JobSpec, RoleSpec
from forgerl_plugins.schedulers.kubernetes.options import DNS_LABEL
from forgerl_plugins.schedulers.slurm.syntax import memory_mb

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.schedulers.kubernetes.options import Options

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
LABEL_JOB = "forgerl.dev/job"
LABEL_ROLE = "forgerl.dev/role"
LABEL_REPLICA = "forgerl.dev/replica"
LABEL_PRIMARY = "forgerl.dev/primary"
ANNOTATION_MODE = "forgerl.dev/mode"  # on the ConfigMap: "jobset" or "jobs"
CONFIG_MOUNT = "/etc/forgerl"
# Downward-API fields set by the Job and JobSet controllers on every pod.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOBSET_JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
JOBSET_RESTARTS = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"


def dns_name(text: str, what: str) -> str:
    """``text`` as a DNS label: lowercase, other characters folded to '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not DNS_LABEL.match(name):
        raise ConfigError(f"{what} {text!r} cannot be made a Kubernetes name (lowercase letters, digits, '-')")
    return name


def container_command(command: tuple[str, ...] | list[str], python: str) -> list[str]:
    """``command`` for the image: this machine's interpreter path means nothing there."""
    argv = list(command)
    if argv and argv[0] in (sys.executable, os.path.realpath(sys.executable)):
        argv[0] = python
    return argv


def config_map_name(name: str) -> str:
    return f"{name}-config"


def job_name(name: str, role: str, replica: int) -> str:
    """The Job of one role replica; JobSet names its child Jobs the same way."""
    return f"{name}-{role}-{replica}"


def render_objects(job: JobSpec, opts: Options) -> list[dict[str, Any]]:
    """Every object :meth:`KubernetesScheduler.submit` creates, in creation order."""
    if not job.roles:
        raise ConfigError(f"job {job.name!r} has no roles: nothing to run")
    if not opts.image:
        raise ConfigError("the kubernetes scheduler needs an image: set scheduler.options.image")
    name = dns_name(job.name, "job name")
    roles = [(dns_name(r.name, "role name"), r) for r in job.roles]
    if len({n for n, _ in roles}) != len(roles):
        raise ConfigError(f"role names must stay distinct as Kubernetes names: {[n for n, _ in roles]}")
    run_dir = _run_dir(job, opts)
    for rname, role in roles:
        longest = f"{job_name(name, rname, role.replicas - 1)}-{role.ranks_per_replica - 1}"
        if len(longest) > 63:
            raise ConfigError(
                f"pod name {longest!r} is longer than Kubernetes allows (63): shorten the job name {job.name!r}"
            )

    mode = "jobset" if opts.use_jobset else "jobs"
    config = _config_map(job, name, opts, run_dir, mode)
    has_config = "config.yaml" in config["data"]
    labels = {**opts.labels, LABEL_JOB: name, "app.kubernetes.io/managed-by": "forgerl"}
    def meta(n, extra=None):
        return {"name": n, "namespace": opts.namespace, "labels": {**labels, **(extra or {})}}

    if opts.use_jobset:
        primaries = [rname for rname, role in roles if role.primary]
        spec: dict[str, Any] = {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            # The run succeeds when its primary role (the trainer) does; the other roles
            # (servers) are then stopped by the JobSet controller.
            "successPolicy": {"operator": "All", "targetReplicatedJobs": primaries},
            "failurePolicy": {"maxRestarts": opts.max_restarts},
            "replicatedJobs": [
                {
                    "name": rname,
                    "replicas": role.replicas,
                    "template": {
                        "metadata": {"labels": {**labels, LABEL_ROLE: rname}},
                        "spec": _job_spec(job, name, rname, role, opts, run_dir, has_config, None),
                    },
                }
                for rname, role in roles
            ],
        }
        if opts.ttl_seconds_after_finished is not None:
            spec["ttlSecondsAfterFinished"] = opts.ttl_seconds_after_finished
        jobset = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta(name), "spec": spec}
        return [config, jobset]

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: name},
            # Ranks look each other up before they are ready.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": opts.master_port, "targetPort": opts.master_port}],
        },
    }
    jobs = []
    for rname, role in roles:
        for replica in range(role.replicas):
            extra = {LABEL_ROLE: rname, LABEL_REPLICA: str(replica), LABEL_PRIMARY: str(role.primary).lower()}
            jobs.append({
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta(job_name(name, rname, replica), extra),
                "spec": _job_spec(job, name, rname, role, opts, run_dir, has_config, replica),
            })
    return [config, service, *jobs]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the run config in the ConfigMap) as readable ``|`` blocks."""


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def render_yaml(job: JobSpec, opts: Options) -> str:
    return yaml.dump_all(render_objects(job, opts), Dumper=_Dumper, sort_keys=False)


def _run_dir(job: JobSpec, opts: Options) -> str:
    run_dir = posixpath.normpath(job.run_dir)
    if not posixpath.isabs(run_dir):
        raise ConfigError(f"run directory {job.run_dir!r} must be an absolute path on a volume the pods mount")
    for vol in opts.volumes:
        if not vol.read_only and (run_dir + "/").startswith(vol.mount_path.rstrip("/") + "/"):
            return run_dir
    mounts = [v.mount_path for v in opts.volumes] or "none"
    raise ConfigError(
        f"run directory {run_dir} is on no writable volume (mounts: {mounts}); add one to "
        "scheduler.options.volumes, e.g. {name: runs, pvc: CLAIM, mount_path: "
        f"{posixpath.dirname(run_dir) or '/'}}}"
    )


def _config_map(job: JobSpec, name: str, opts: Options, run_dir: str, mode: str) -> dict:
    data = {"job.yaml": yaml.safe_dump(_jsonable(asdict(job)), sort_keys=False)}
    config = Path(job.run_dir) / "config.yaml"
    if config.is_file():
        data["config.yaml"] = config.read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(name),
            "namespace": opts.namespace,
            "labels": {**opts.labels, LABEL_JOB: name, "app.kubernetes.io/managed-by": "forgerl"},
            "annotations": {ANNOTATION_MODE: mode},
        },
        "data": data,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _job_spec(job: JobSpec, name: str, rname: str, role: RoleSpec, opts: Options,
              run_dir: str, has_config: bool, replica: int | None) -> dict[str, Any]:
    ranks = role.ranks_per_replica
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": ranks,
        "parallelism": ranks,
        "backoffLimit": role.max_restarts,
        "template": _pod_template(job, name, rname, role, opts, run_dir, has_config, replica),
    }
    if opts.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = opts.active_deadline_seconds
    if replica is not None and opts.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = opts.ttl_seconds_after_finished
    return spec


def _resources(role: RoleSpec, opts: Options) -> dict[str, dict[str, str]]:
    res = role.resources
    if role.ranks_per_replica < 1 or res.nodes < 1 or role.ranks_per_replica % res.nodes:
        raise ConfigError(
            f"role {role.name!r}: {role.ranks_per_replica} ranks do not divide evenly over {res.nodes} nodes"
        )
    per_node = role.ranks_per_replica // res.nodes
    if res.gpus % per_node:
        raise ConfigError(f"role {role.name!r}: {res.gpus} GPUs per node do not split over {per_node} ranks")
    requests = {"cpu": str(max(1, res.cpus // per_node))}
    limits: dict[str, str] = {}
    if res.memory is not None:
        try:
            mb = memory_mb(res.memory)
        except ValueError as exc:
            raise ConfigError(f"role {role.name!r}: {exc}") from None
        requests["memory"] = limits["memory"] = f"{max(1, mb // per_node)}Mi"
    if res.gpus:
        # Extended resources must be given as limits; requests, when present, must match.
        requests[opts.gpu_resource] = limits[opts.gpu_resource] = str(res.gpus // per_node)
    out = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _env(job: JobSpec, name: str, rname: str, role: RoleSpec, opts: Options,
         run_dir: str, has_config: bool, replica: int | None) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "FORGE_RUN_DIR", "value": run_dir},
        {"name": "FORGE_JOB_NAME", "value": job.name},
        {"name": "FORGE_ROLE", "value": role.name},
        {"name": "FORGE_REPLICA", **(field(JOBSET_JOB_INDEX) if replica is None else {"value": str(replica)})},
        {"name": "RANK", **field(COMPLETION_INDEX)},
        {"name": "WORLD_SIZE", "value": str(role.ranks_per_replica)},
        # One process per pod.
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "LOCAL_WORLD_SIZE", "value": "1"},
    ]
    if replica is None:
        # >0 after the JobSet controller restarted the run: resume from the last checkpoint.
        env.append({"name": "FORGE_REQUEUED", **field(JOBSET_RESTARTS)})
    if has_config:
        env.append({"name": "FORGE_CONFIG", "value": f"{CONFIG_MOUNT}/config.yaml"})
    if role.ranks_per_replica > 1:
        # $(FORGE_REPLICA) is expanded by the kubelet from the variable defined above.
        env.append({"name": "MASTER_ADDR", "value": f"{name}-{rname}-$(FORGE_REPLICA)-0.{name}"})
        env.append({"name": "MASTER_PORT", "value": str(opts.master_port)})
    for source in (job.env, opts.env, role.env):
        for key, value in source.items():
            env.append({"name": key, "value": str(value)})
    return env


def _pod_template(job: JobSpec, name: str, rname: str, role: RoleSpec, opts: Options,
                  run_dir: str, has_config: bool, replica: int | None) -> dict[str, Any]:
    if not role.command:
        raise ConfigError(f"role {role.name!r} has no command")
    mounts = [
        {"name": v.name, "mountPath": v.mount_path, **({"readOnly": True} if v.read_only else {}),
         **({"subPath": v.sub_path} if v.sub_path else {})}
        for v in opts.volumes
    ]
    volumes: list[dict[str, Any]] = [
        {"name": v.name, **({"persistentVolumeClaim": {"claimName": v.pvc, **({"readOnly": True} if v.read_only else {})}}
                            if v.pvc else {"hostPath": {"path": v.host_path, "type": "DirectoryOrCreate"}})}
        for v in opts.volumes
    ]
    mounts.append({"name": "forge-config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    volumes.append({"name": "forge-config", "configMap": {"name": config_map_name(name)}})
    if opts.shm_size:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}})

    container: dict[str, Any] = {
        "name": rname,
        "image": opts.image,
        "command": container_command(role.command, opts.python),
        "env": _env(job, name, rname, role, opts, run_dir, has_config, replica),
        "resources": _resources(role, opts),
        "volumeMounts": mounts,
    }
    if opts.image_pull_policy:
        container["imagePullPolicy"] = opts.image_pull_policy
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes}
    if replica is not None:
        # Indexed Job pods are named <job>-<index>; with this subdomain and our headless
        # Service they resolve as <job>-<index>.<run>.
        spec["subdomain"] = name
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    if opts.node_selector:
        spec["nodeSelector"] = dict(opts.node_selector)
    if opts.tolerations:
        spec["tolerations"] = [
            {k: v for k, v in {"key": t.key, "operator": t.operator, "value": t.value, "effect": t.effect,
                               "tolerationSeconds": t.toleration_seconds}.items() if v is not None}
            for t in opts.tolerations
        ]
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    if opts.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in opts.image_pull_secrets]
    labels = {**opts.labels, LABEL_JOB: name, LABEL_ROLE: rname, LABEL_PRIMARY: str(role.primary).lower()}
    if replica is not None:
        labels[LABEL_REPLICA] = str(replica)
    metadata: dict[str, Any] = {"labels": labels}
    if opts.annotations:
        metadata["annotations"] = dict(opts.annotations)
    return {"metadata": metadata, "spec": spec}
