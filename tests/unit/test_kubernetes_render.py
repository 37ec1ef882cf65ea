"""The kubernetes scheduler's manifests, without a cluster: every rendered object
validates against the Kubernetes OpenAPI schemas (kubernetes-validate, strict) of a fixed
Kubernetes version; the JobSet's own fields against JobSet's CRD schema; and the
rendezvous, resources and bad input behave as documented."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from forgerl.errors import ConfigError
from forgerl.types import JobSpec, Resources, RoleSpec
from forgerl_plugins.schedulers.kubernetes.manifests import render_objects, render_yaml
from forgerl_plugins.schedulers.kubernetes.scheduler import KubernetesScheduler

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

K8S_VERSION = "1.33.0"

# spec of jobset.x-k8s.io/v1alpha2 JobSet, from the CRD of kubernetes-sigs/jobset v0.9.1
# (config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml, Apache-2.0), descriptions
# dropped. The Job templates inside are checked as core batch/v1 Jobs instead.
_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_STRS = {"type": "array", "items": _S}
JOBSET_SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "coordinator": {"type": "object", "required": ["replicatedJob"],
                        "properties": {"jobIndex": _I, "podIndex": _I, "replicatedJob": _S}},
        "failurePolicy": {"type": "object", "properties": {
            "maxRestarts": _I,
            "restartStrategy": {"type": "string", "enum": ["Recreate", "BlockingRecreate"]},
            "rules": {"type": "array", "items": {"type": "object", "required": ["action", "name"], "properties": {
                "action": {"type": "string",
                           "enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]},
                "name": _S, "onJobFailureReasons": _STRS, "targetReplicatedJobs": _STRS}}}}},
        "managedBy": _S,
        "network": {"type": "object", "properties": {
            "enableDNSHostnames": _B, "publishNotReadyAddresses": _B, "subdomain": _S}},
        "replicatedJobs": {"type": "array", "items": {"type": "object", "required": ["name", "template"],
                                                      "properties": {
            "dependsOn": {"type": "array", "maxItems": 5, "items": {
                "type": "object", "required": ["name", "status"],
                "properties": {"name": _S, "status": {"type": "string", "enum": ["Ready", "Complete"]}}}},
            "groupName": _S, "name": _S, "replicas": _I,
            "template": {"type": "object", "properties": {"metadata": {"type": "object"},
                                                          "spec": {"type": "object"}}}}}},
        "startupPolicy": {"type": "object", "required": ["startupPolicyOrder"], "properties": {
            "startupPolicyOrder": {"type": "string", "enum": ["AnyOrder", "InOrder"]}}},
        "successPolicy": {"type": "object", "required": ["operator"], "properties": {
            "operator": {"type": "string", "enum": ["All", "Any"]}, "targetReplicatedJobs": _STRS}},
        "suspend": _B,
        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "volumeClaimPolicies": {"type": "array"},
    },
}


def _strict(schema: Any) -> Any:
    """Refuse unknown keys everywhere (an API server silently prunes them from CRs)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and out.get("type") == "object":
            out["additionalProperties"] = False
        return out
    return schema


VOLUMES = [
    {"name": "runs", "pvc": "forge-runs", "mount_path": "/runs"},
    {"name": "models", "host_path": "/mnt/models", "mount_path": "/models", "read_only": True},
]

TRAINER = RoleSpec(name="trainer", command=("python", "-m", "forgerl.train"), primary=True, ranks_per_replica=4,
                   resources=Resources(cpus=16, gpus=4, memory="64G", nodes=2), env={"NCCL_DEBUG": "WARN"})
GENERATOR = RoleSpec(name="generator", command=("python", "-m", "vllm.entrypoints.openai.api_server"), replicas=2,
                     resources=Resources(cpus=8, gpus=1, memory="32Gi"), max_restarts=2)


def _opts(**kw) -> KubernetesScheduler.Options:
    base = dict(
        image="ghcr.io/example/forgerl:0.1", namespace="rl", volumes=VOLUMES, node_selector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        service_account="forge", priority_class="high", image_pull_secrets=["regcred"], shm_size="16Gi",
        image_pull_policy="IfNotPresent", env={"HF_HOME": "/models/hf"}, labels={"team": "rl"},
        annotations={"example.com/owner": "rl"}, active_deadline_seconds=86400, ttl_seconds_after_finished=3600,
    )
    return KubernetesScheduler.Options(**{**base, **kw})


def _job(tmp_path=None, *roles: RoleSpec, run_dir: str = "/runs/grpo-1") -> JobSpec:
    return JobSpec(name="grpo_1", run_dir=run_dir, roles=roles or (GENERATOR, TRAINER), env={"FORGE_SEED": "7"})


def _validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "JobSet":
        jsonschema.validate(obj["spec"], _strict(JOBSET_SPEC_SCHEMA))
        for rj in obj["spec"]["replicatedJobs"]:
            as_job = {"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}-0",
                                   **copy.deepcopy(rj["template"]["metadata"])},
                      "spec": rj["template"]["spec"]}
            kubernetes_validate.validate(as_job, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("use_jobset", [True, False], ids=["jobset", "indexed-jobs"])
def test_every_manifest_validates_strictly(use_jobset):
    objs = render_objects(_job(), _opts(use_jobset=use_jobset))
    kinds = [o["kind"] for o in objs]
    assert kinds == (["ConfigMap", "JobSet"] if use_jobset else ["ConfigMap", "Service"] + ["Job"] * 3), kinds
    for obj in objs:
        _validate(obj)


def test_validation_catches_a_misspelt_field():
    # The checks above would be worthless if strict mode let unknown fields through.
    objs = render_objects(_job(), _opts(use_jobset=False))
    bad = copy.deepcopy(objs[-1])
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    jobset = render_objects(_job(), _opts())[1]
    jobset["spec"]["network"]["enableDnsHostnames"] = True
    with pytest.raises(jsonschema.ValidationError):
        _validate(jobset)


def _container(obj: dict[str, Any], role: str | None = None) -> dict[str, Any]:
    if obj["kind"] == "JobSet":
        rj = next(r for r in obj["spec"]["replicatedJobs"] if r["name"] == role)
        return rj["template"]["spec"]["template"]["spec"]["containers"][0]
    return obj["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_jobset_rendezvous_and_resources():
    config, jobset = render_objects(_job(), _opts())
    spec = jobset["spec"]
    assert jobset["metadata"]["name"] == "grpo-1" and jobset["metadata"]["namespace"] == "rl"
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "grpo-1"}
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    trainer = next(r for r in spec["replicatedJobs"] if r["name"] == "trainer")
    assert trainer["replicas"] == 1
    assert (trainer["template"]["spec"]["completionMode"], trainer["template"]["spec"]["completions"]) == ("Indexed", 4)
    env = _env(_container(jobset, "trainer"))
    # Rank 0 of this replica, through JobSet's headless service.
    assert env["MASTER_ADDR"] == "grpo-1-trainer-$(FORGE_REPLICA)-0.grpo-1" and env["MASTER_PORT"] == "29500"
    assert env["RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["FORGE_REPLICA"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert env["FORGE_REQUEUED"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"}}
    assert (env["WORLD_SIZE"], env["FORGE_ROLE"], env["FORGE_RUN_DIR"]) == ("4", "trainer", "/runs/grpo-1")
    assert (env["FORGE_SEED"], env["HF_HOME"], env["NCCL_DEBUG"]) == ("7", "/models/hf", "WARN")
    names = [e["name"] for e in _container(jobset, "trainer")["env"]]
    assert names.index("FORGE_REPLICA") < names.index("MASTER_ADDR"), "$(FORGE_REPLICA) must be defined first"
    # 4 ranks over 2 nodes: each pod gets half of a node's share.
    assert _container(jobset, "trainer")["resources"] == {
        "requests": {"cpu": "8", "memory": "32768Mi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "32768Mi", "nvidia.com/gpu": "2"},
    }
    gen = _env(_container(jobset, "generator"))
    assert "MASTER_ADDR" not in gen, "a single-rank server needs no rendezvous"
    pod = next(r for r in spec["replicatedJobs"] if r["name"] == "generator")["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["serviceAccountName"] == "forge"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["runs"]["persistentVolumeClaim"] == {"claimName": "forge-runs"}
    assert vols["models"]["hostPath"]["path"] == "/mnt/models"
    assert vols["forge-config"]["configMap"] == {"name": "grpo-1-config"}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert config["metadata"]["annotations"] == {"forgerl.dev/mode": "jobset"}


def test_indexed_jobs_get_a_headless_service_and_one_job_per_replica():
    config, service, *jobs = render_objects(_job(), _opts(use_jobset=False))
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"forgerl.dev/job": "grpo-1"}
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert [j["metadata"]["name"] for j in jobs] == ["grpo-1-generator-0", "grpo-1-generator-1", "grpo-1-trainer-0"]
    for j in jobs:
        assert j["spec"]["template"]["spec"]["subdomain"] == "grpo-1"
    assert jobs[1]["spec"]["backoffLimit"] == 2  # the generator's max_restarts
    assert _env(_container(jobs[1]))["FORGE_REPLICA"] == "1"
    trainer_env = _env(_container(jobs[2]))
    # Indexed Job pods are <job>-<index>: rank 0 of the trainer resolves through the Service.
    assert trainer_env["MASTER_ADDR"] == "grpo-1-trainer-$(FORGE_REPLICA)-0.grpo-1"
    assert trainer_env["FORGE_REPLICA"] == "0"
    assert jobs[2]["metadata"]["labels"]["forgerl.dev/primary"] == "true"
    assert config["metadata"]["annotations"] == {"forgerl.dev/mode": "jobs"}


def test_config_map_carries_the_run_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("loop:\n  steps: 2\n")
    opts = _opts(volumes=[{"name": "runs", "host_path": str(tmp_path), "mount_path": str(tmp_path)}])
    objs = render_objects(_job(None, run_dir=str(run_dir)), opts)
    assert objs[0]["data"]["config.yaml"] == "loop:\n  steps: 2\n"
    assert yaml.safe_load(objs[0]["data"]["job.yaml"])["roles"][1]["name"] == "trainer"
    assert _env(_container(objs[1], "trainer"))["FORGE_CONFIG"] == "/etc/forgerl/config.yaml"
    # --dry-run's YAML is the same objects, and writes nothing.
    assert list(yaml.safe_load_all(render_yaml(_job(None, run_dir=str(run_dir)), opts))) == objs
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize(
    "job, opts, message",
    [
        (_job(), {"image": None}, "needs an image"),
        (_job(None, run_dir="/elsewhere/run"), {}, "on no writable volume"),
        (_job(None, run_dir="relative/run"), {}, "absolute"),
        (_job(None, RoleSpec(name="t", command=("x",), ranks_per_replica=3, resources=Resources(nodes=2))),
         {}, "divide evenly"),
        (_job(None, RoleSpec(name="t", command=("x",), ranks_per_replica=2, resources=Resources(gpus=3))),
         {}, "do not split"),
        (_job(None, RoleSpec(name="t", command=("x",), resources=Resources(memory="lots"))), {}, "invalid memory"),
        (_job(None, RoleSpec(name="t", command=())), {}, "no command"),
        (_job(None, RoleSpec(name="a_b", command=("x",)), RoleSpec(name="a-b", command=("x",))), {}, "distinct"),
        (JobSpec(name="x" * 60, run_dir="/runs/x", roles=(RoleSpec(name="trainer", command=("x",)),)), {},
         "longer than Kubernetes allows"),
    ],
)
def test_bad_input_is_a_config_error(job, opts, message):
    with pytest.raises(ConfigError, match=message):
        render_objects(job, _opts(**opts))


@pytest.mark.parametrize(
    "field, value",
    [("namespace", "Not_A_Label"), ("shm_size", "lots"), ("master_port", 0), ("env", {"A B": "x"}),
     ("volumes", [{"name": "v", "mount_path": "/v"}]),
     ("volumes", [{"name": "v", "mount_path": "/v", "pvc": "c", "host_path": "/h"}]),
     ("volumes", [{"name": "v", "mount_path": "relative", "pvc": "c"}]),
     ("tolerations", [{"operator": "Maybe"}])],
)
def test_invalid_options_are_refused(field, value):
    with pytest.raises(ValidationError):
        KubernetesScheduler.Options(**{field: value})


def test_this_machines_python_becomes_the_images():
    import sys

    role = RoleSpec(name="trainer", command=(sys.executable, "-m", "forgerl.worker", "--run-dir", "/runs/grpo-1"),
                    primary=True)
    jobset = render_objects(_job(None, role), _opts(python="/opt/venv/bin/python"))[1]
    assert _container(jobset, "trainer")["command"] == ["/opt/venv/bin/python", "-m", "forgerl.worker",
                                                         "--run-dir", "/runs/grpo-1"]
