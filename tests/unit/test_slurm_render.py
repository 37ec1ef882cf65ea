"""The slurm scheduler's batch script, without a Slurm: content, placement, bad input, and
the script's shell helpers run in bash."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.registry.plugins import Registry  # noqa: F401  (the registry must import with the plugin)
from forgerl.types import JobSpec, JobState, Resources, RoleSpec
from forgerl_plugins.schedulers.slurm.render import _FUNCTIONS, _SELF_REQUEUE, place
from forgerl_plugins.schedulers.slurm.scheduler import SlurmScheduler, _detail, _exit_code, _one_line
from forgerl_plugins.schedulers.slurm.syntax import memory_mb, slurm_memory
from tests.helpers.timing import scaled


def _job(tmp_path: Path, *roles: RoleSpec, **kw) -> JobSpec:
    return JobSpec(name=kw.pop("name", "run1"), run_dir=str(tmp_path / "run"), roles=roles, **kw)


TRAINER = RoleSpec(name="trainer", command=("python", "-m", "forgerl.train", "--x", "a b"), primary=True,
                   ranks_per_replica=2, resources=Resources(cpus=4, gpus=2, memory="32G"))
GENERATOR = RoleSpec(name="generator", command=("python", "-m", "vllm.entrypoints.openai.api_server"),
                     replicas=2, resources=Resources(cpus=2, gpus=1, memory="16Gi"), max_restarts=3,
                     env={"VLLM_LOGGING_LEVEL": "INFO"})


def render(tmp_path: Path, *roles: RoleSpec, env=None, **opts) -> str:
    job = _job(tmp_path, *(roles or (GENERATOR, TRAINER)), env=env or {})
    return SlurmScheduler(SlurmScheduler.Options(**opts)).render(job)


def sbatch_lines(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def test_script_carries_every_option(tmp_path):
    script = render(
        tmp_path, gpus_per_node=8, partition="gpu", account="proj", qos="high", time="2:00:00",
        constraint="h100", extra_sbatch=["#SBATCH --reservation=r1", "--mail-type=END"], exclusive=True,
        requeue=True, container_image="nvcr.io/nvidia/pytorch:25.01-py3",
        container_mounts=["/data:/data", "/scratch:/scratch:ro"], container_workdir="/work",
        setup=["source /opt/venv/bin/activate"], env={"HF_HOME": "/data/hf"}, srun_args=["--mpi=none"],
    )
    sb = sbatch_lines(script)
    for line in ("--job-name=run1", "--nodes=1", "--gpus-per-node=4", "--partition=gpu", "--account=proj",
                 "--qos=high", "--time=2:00:00", "--constraint=h100", "--exclusive", "--requeue",
                 "--reservation=r1", "--mail-type=END", "--open-mode=append",
                 f"--output={tmp_path}/run/logs/slurm-%j.out"):
        assert line in sb, (line, sb)
    # Both generators (1 GPU, 16G) and the trainer (2 GPUs, 32G) share the one node.
    assert "--mem=65536M" in sb and "--cpus-per-task=8" in sb, sb
    assert "source /opt/venv/bin/activate" in script
    assert "export HF_HOME=/data/hf" in script
    assert "export FORGE_REQUEUED=${SLURM_RESTART_COUNT:-0}" in script
    assert f"export FORGE_RUN_DIR={tmp_path}/run" in script
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/data:/data,/scratch:/scratch:ro" \
        " --container-workdir=/work" in script
    assert "--mpi=none" in script
    # Commands are quoted for the shell: an argument with a space stays one argument.
    assert "python -m forgerl.train --x 'a b'" in script


def test_roles_become_pinned_steps_with_rendezvous_for_multi_rank(tmp_path):
    script = render(tmp_path, gpus_per_node=8)
    blocks = script.split("\n# ")
    gen0 = next(b for b in blocks if b.startswith("generator-0:"))
    trainer = next(b for b in blocks if b.startswith("trainer-0:"))
    assert "export FORGE_ROLE=generator FORGE_REPLICA=0" in gen0
    assert "export VLLM_LOGGING_LEVEL=INFO" in gen0
    assert "forge_supervise 3 " in gen0 and "/logs/generator-0.log" in gen0
    assert "--ntasks=1 " in gen0 and "--gpus-per-node=1" in gen0 and "--mem=16384M" in gen0
    assert "MASTER_ADDR" not in gen0  # a single-rank server needs no rendezvous
    assert "export FORGE_ROLE=trainer FORGE_REPLICA=0" in trainer
    assert 'export MASTER_ADDR="${FORGE_NODES[0]}"' in trainer
    assert 'export MASTER_PORT=$(forge_port 2 "${FORGE_NODES[0]}")' in trainer
    assert "--ntasks=2 --ntasks-per-node=2 --cpus-per-task=2 --gpus-per-node=2" in trainer
    assert "--exact" in trainer and "--kill-on-bad-exit=1" in trainer and "--label" in trainer
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in trainer
    # The script waits for the trainer only, then stops the generators.
    assert "for pid in $PID_2; do" in script
    assert 'forge_stop "generator-0:$PID_0" "generator-1:$PID_1"' in script
    assert script.rstrip().endswith("exit $FORGE_RC")


def test_script_is_valid_bash(tmp_path):
    script = render(tmp_path, gpus_per_node=8, requeue=True, container_image="img")
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_placement_packs_by_gpus_and_gives_multi_node_replicas_their_own_nodes():
    big = RoleSpec(name="trainer", command=("t",), primary=True, ranks_per_replica=16,
                   resources=Resources(cpus=16, gpus=8, nodes=2))
    gen = RoleSpec(name="gen", command=("g",), replicas=3, resources=Resources(cpus=12, gpus=4))
    job = JobSpec(name="j", run_dir="/r", roles=(gen, big))
    plan = place(job, SlurmScheduler.Options(gpus_per_node=8))
    where = {s.label: s.nodes for s in plan.steps}
    assert where == {"gen-0": (0,), "gen-1": (0,), "gen-2": (1,), "trainer-0": (2, 3)}, where
    assert plan.nodes == 4 and plan.gpus_per_node == 8
    trainer = plan.steps[-1]
    assert (trainer.ranks, trainer.ranks_per_node, trainer.cpus_per_task) == (16, 8, 2)
    # cpus_per_node bounds packing too.
    plan = place(job, SlurmScheduler.Options(gpus_per_node=8, cpus_per_node=20))
    assert [s.nodes for s in plan.steps[:3]] == [(0,), (1,), (2,)]
    # A larger `nodes` is honoured; a smaller one is an error that says how many are needed.
    assert place(job, SlurmScheduler.Options(gpus_per_node=8, nodes=6)).nodes == 6
    with pytest.raises(ConfigError, match="need 4 nodes"):
        place(job, SlurmScheduler.Options(gpus_per_node=8, nodes=2))


@pytest.mark.parametrize(
    "role, opts, message",
    [
        (RoleSpec(name="t", command=("x",), resources=Resources(gpus=1)), {}, "gpus_per_node"),
        (RoleSpec(name="t", command=("x",), resources=Resources(gpus=9)), {"gpus_per_node": 8}, "9 GPUs"),
        (RoleSpec(name="t", command=("x",), ranks_per_replica=3, resources=Resources(nodes=2)), {}, "divide"),
        (RoleSpec(name="t", command=("x",), resources=Resources(memory="lots")), {}, "invalid memory"),
        (RoleSpec(name="t", command=()), {}, "no command"),
        (RoleSpec(name="bad name", command=("x",)), {}, "role name"),
        (RoleSpec(name="t", command=("x",), env={"1BAD": "x"}), {}, "environment variable"),
    ],
)
def test_bad_roles_are_config_errors(tmp_path, role, opts, message):
    with pytest.raises(ConfigError, match=message):
        render(tmp_path, role, **opts)


@pytest.mark.parametrize(
    "field, value",
    [("memory", "16 gigs"), ("memory", "1.5G"), ("time", "1h"), ("time", "1:00:00:00"),
     ("extra_sbatch", ["exclusive"]), ("env", {"A-B": "x"}), ("nodes", 0), ("poll_interval", 0)],
)
def test_invalid_option_strings_are_refused(field, value):
    with pytest.raises(ValidationError):
        SlurmScheduler.Options(**{field: value})


def test_resource_string_syntax():
    assert [slurm_memory(m) for m in ("16G", "512m", "16Gi", "2048")] == ["16G", "512M", "16G", "2048"]
    assert [memory_mb(m) for m in ("16G", "512M", "1T", "2048", "1024K")] == [16384, 512, 1048576, 2048, 1]
    for t in ("90", "30:00", "1:00:00", "2-00:00:00", "2-12", "UNLIMITED"):
        assert SlurmScheduler.Options(time=t).time == t


def test_dry_run_writes_nothing(tmp_path):
    render(tmp_path, gpus_per_node=8)
    assert not (tmp_path / "run").exists()


def test_submit_without_sbatch_is_a_user_error_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    sched = SlurmScheduler(SlurmScheduler.Options())
    with pytest.raises(BackendUnavailable, match="sbatch not found on PATH"):
        sched.submit(_job(tmp_path, RoleSpec(name="t", command=("x",), primary=True)))
    assert not (tmp_path / "run").exists()
    with pytest.raises(BackendUnavailable, match="scontrol not found"):
        sched.status("12")


def test_slurm_messages_become_one_line_and_exit_codes_shell_style():
    err = ("sbatch: error: invalid partition specified: nope\n"
           "sbatch: error: Batch job submission failed: Invalid partition name specified\n")
    assert _one_line(err) == "invalid partition specified: nope; Batch job submission failed: " \
                             "Invalid partition name specified"
    assert [_exit_code(c) for c in ("0:0", "3:0", "0:15", "")] == [0, 3, 143, None]
    assert _detail(JobState.FAILED, "TIMEOUT", "TimeLimit", 0) == "TIMEOUT, reason: TimeLimit"
    assert _detail(JobState.PENDING, "PENDING", "BeginTime", 1) == "reason: BeginTime, restarted 1x"
    assert _detail(JobState.COMPLETED, "COMPLETED", "None", 0) == ""


# ---------------------------------------------------------------- the script's helpers


def _bash(snippet: str, **env: str) -> subprocess.CompletedProcess[str]:
    functions = _FUNCTIONS.format(ppj=40, base=10000, slots=550, stop_timeout=5)
    return subprocess.run(["bash", "-c", functions + "\n" + snippet], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env}, timeout=scaled(30))


def test_rendezvous_port_differs_between_jobs_and_skips_ports_in_use():
    def port(job_id: int, index: int = 0) -> int:
        proc = _bash(f"forge_port {index} here", SLURM_JOB_ID=str(job_id), FORGE_HERE="here")
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    first = port(1234)
    assert 10000 <= first < 32768 and port(1235) != first and port(1234, 1) != first
    with socket.socket() as s:  # something already listens on the derived port
        s.bind(("127.0.0.1", first))
        s.listen()
        assert port(1234) == first + 1


def test_supervisor_restarts_a_failing_step_up_to_its_limit(tmp_path):
    counter = tmp_path / "n"
    # Fails twice, then succeeds.
    step = f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; echo run $n; ((n >= 2))"
    proc = _bash(f"forge_supervise 2 {tmp_path}/log bash -c '{step}'; echo rc=$?",
                 FORGE_RESTART_DELAY="0.1", FORGE_ROLE="gen", FORGE_REPLICA="0", FORGE_STOP_FLAG=str(tmp_path / "stop"))
    assert proc.stdout.splitlines()[-1] == "rc=0", proc.stdout
    assert "restart 2 of 2" in proc.stdout
    assert (tmp_path / "log").read_text().split("\n")[:3] == ["run 0", "run 1", "run 2"]

    counter.unlink()
    proc = _bash(f"forge_supervise 1 {tmp_path}/log bash -c '{step}'; echo rc=$?",
                 FORGE_RESTART_DELAY="0.1", FORGE_ROLE="gen", FORGE_REPLICA="0", FORGE_STOP_FLAG=str(tmp_path / "stop"))
    assert proc.stdout.splitlines()[-1] == "rc=1", proc.stdout

    # Once the job is stopping, a step that ends is not started again.
    counter.unlink()
    (tmp_path / "stop").touch()
    proc = _bash(f"forge_supervise 5 {tmp_path}/log bash -c '{step}'; echo rc=$?",
                 FORGE_RESTART_DELAY="0.1", FORGE_ROLE="gen", FORGE_REPLICA="0", FORGE_STOP_FLAG=str(tmp_path / "stop"))
    assert proc.stdout.splitlines()[-1] == "rc=1" and "restart" not in proc.stdout, proc.stdout


def test_trainer_stopped_by_sigterm_requeues_the_job_when_requeue_is_on(tmp_path):
    """Exit 143 (stopped on SIGTERM after its checkpoint) with `requeue: true`: the script
    asks Slurm to run the job again (a fake scontrol records how); any other status, or no
    `requeue`, ends the job with the trainer's status."""
    rendered = render(tmp_path, gpus_per_node=8, requeue=True)
    # After the primary's wait and the other roles' stop, before the script's own exit.
    assert rendered.index("forge_stop ") < rendered.index(_SELF_REQUEUE.strip()) < rendered.rindex("exit $FORGE_RC")
    assert "scontrol requeue" not in render(tmp_path, gpus_per_node=8, requeue=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nexit ${{FAKE_RC:-0}}\n')
    fake.chmod(0o755)

    def script(rc: int, **env: str) -> subprocess.CompletedProcess[str]:
        body = f"FORGE_RC={rc}\n{_SELF_REQUEUE}\necho reached-exit; exit $FORGE_RC"
        return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=scaled(30),
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77",
                                   "FORGE_RUN_DIR": "/runs/r1", **env})

    proc = script(143)
    assert (proc.returncode, calls.read_text()) == (0, "requeue 77\n"), (proc, calls.read_text())
    assert "requeueing job 77" in proc.stdout and "reached-exit" not in proc.stdout, proc.stdout
    calls.unlink()
    for rc in (0, 1, 2, 137):
        proc = script(rc)
        assert proc.returncode == rc and not calls.exists(), (rc, proc.stdout)
    proc = script(143, FAKE_RC="1")  # Slurm refused (e.g. the job is being cancelled)
    assert proc.returncode == 143 and "forge run --resume /runs/r1" in proc.stdout, proc.stdout


def test_job_index_survives_the_controller_forgetting_but_not_a_reset(tmp_path, monkeypatch):
    from forgerl_plugins.schedulers.slurm.scheduler import _recall, _remember

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "slurm" / "job_id").write_text("42\n")
    _remember("42", run_dir)
    assert _recall("42") == run_dir
    assert _recall("7") is None
    # A reset cluster hands out 42 again to another run: the old entry no longer applies.
    (run_dir / "slurm" / "job_id").write_text("43\n")
    assert _recall("42") is None


def test_container_steps_use_the_images_python(tmp_path):
    import sys

    role = RoleSpec(name="trainer", command=(sys.executable, "-m", "forgerl.worker"), primary=True)
    assert f"{sys.executable} -m forgerl.worker" in render(tmp_path, role)
    script = render(tmp_path, role, container_image="img", container_python="python3")
    assert "\n        python3 -m forgerl.worker" in script, script
