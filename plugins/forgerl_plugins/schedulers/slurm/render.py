"""JobSpec → one sbatch script.

The whole run is one allocation. Each role replica is one ``srun`` step pinned to
explicit nodes of that allocation (``--nodelist`` built from ``scontrol show hostnames``)
with ``--exact`` resources, so steps of different roles can share a node when its GPUs and
CPUs allow and never wait on each other. Placement is computed here, at render time, so
``--dry-run`` shows exactly where everything will run.

Inside the job: MASTER_PORT of a multi-rank replica is derived from the job id (two jobs
on one node get different ports) and moved past any port already listening on the master
node; RANK/LOCAL_RANK/WORLD_SIZE come from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS in a
small per-task wrapper. The script waits for the primary role, then stops the others and
exits with the primary's status; with ``requeue``, a primary stopped by SIGTERM after its
checkpoint (status 143) has the script requeue the job instead (see ``_SELF_REQUEUE``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forgerl.errors import ConfigError
from forgerl.types import JobSpec, RoleSpec
from forgerl_plugins.schedulers.slurm.syntax import memory_mb

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.schedulers.slurm.options import Options

# Rendezvous ports: below Linux's default ephemeral range (32768+), so that an outgoing
# connection never holds the port a job derives; 40 consecutive ports per job.
PORT_BASE, PORT_SLOTS, PORTS_PER_JOB = 10000, 550, 40

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Step:
    """One replica of one role, placed on nodes of the allocation."""

    role: RoleSpec
    replica: int
    index: int  # position among all steps: the replica's rendezvous port offset
    nodes: tuple[int, ...]  # indices into the allocation's node list
    ranks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    mem_mb: int | None

    @property
    def label(self) -> str:
        """``<role>-<replica>``: the step's name, and its log's (``logs/<label>.log``)."""
        return f"{self.role.name}-{self.replica}"

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * len(self.nodes)


@dataclass
class Placement:
    steps: list[Step]
    nodes: int
    cpus_per_node: int  # most CPUs the steps use on any one node
    gpus_per_node: int
    mem_mb_per_node: int | None


def place(job: JobSpec, opts: Options) -> Placement:
    """Pack replicas onto nodes, first fit: multi-node replicas take whole nodes of their
    own; single-node replicas share nodes within ``gpus_per_node`` and ``cpus_per_node``."""
    if not job.roles:
        raise ConfigError(f"job {job.name!r} has no roles: nothing to run")
    names = [r.name for r in job.roles]
    for name in names:
        if not _ROLE_NAME.fullmatch(name):
            raise ConfigError(f"role name {name!r}: use letters, digits, '.', '_' or '-'")
    if len(set(names)) != len(names):
        raise ConfigError(f"role names must be unique, got {names}")

    load: list[list[int]] = []  # per node: [gpus, cpus, mem_mb]
    shared: list[bool] = []  # False for nodes held by a multi-node replica
    steps: list[Step] = []
    for role in job.roles:
        res = role.resources
        if role.replicas < 1 or role.ranks_per_replica < 1 or res.nodes < 1:
            raise ConfigError(f"role {role.name!r}: replicas, ranks_per_replica and nodes must be at least 1")
        if role.ranks_per_replica % res.nodes:
            raise ConfigError(
                f"role {role.name!r}: {role.ranks_per_replica} ranks do not divide evenly over {res.nodes} nodes"
            )
        if res.gpus and not opts.gpus_per_node:
            raise ConfigError(
                f"role {role.name!r} needs {res.gpus} GPUs per node: set scheduler.options.gpus_per_node "
                "to the number of GPUs your nodes have"
            )
        if res.gpus > opts.gpus_per_node:
            raise ConfigError(
                f"role {role.name!r} needs {res.gpus} GPUs per node but gpus_per_node is {opts.gpus_per_node}"
            )
        mem = _memory_mb(role)
        rpn = role.ranks_per_replica // res.nodes
        cpt = max(1, res.cpus // rpn)
        cpus = cpt * rpn
        if opts.cpus_per_node and cpus > opts.cpus_per_node:
            raise ConfigError(
                f"role {role.name!r} needs {cpus} CPUs per node but cpus_per_node is {opts.cpus_per_node}"
            )
        for replica in range(role.replicas):
            if res.nodes > 1:
                first = len(load)
                load += [[res.gpus, cpus, mem or 0] for _ in range(res.nodes)]
                shared += [False] * res.nodes
                where = tuple(range(first, first + res.nodes))
            else:
                where = (_first_fit(load, shared, res.gpus, cpus, mem or 0, opts),)
            steps.append(Step(role, replica, len(steps), where, rpn, cpt, res.gpus, mem))

    nodes = len(load)
    if opts.nodes is not None:
        if opts.nodes < nodes:
            raise ConfigError(
                f"the roles need {nodes} nodes ({_summary(steps)}) but scheduler.options.nodes is {opts.nodes}"
            )
        nodes = opts.nodes
    mem_total = max(node[2] for node in load)
    return Placement(
        steps=steps,
        nodes=nodes,
        cpus_per_node=max(node[1] for node in load),
        gpus_per_node=max(node[0] for node in load),
        mem_mb_per_node=mem_total or None,
    )


def _first_fit(load: list[list[int]], shared: list[bool], gpus: int, cpus: int, mem: int,
               opts: Options) -> int:
    for i, (g, c, _) in enumerate(load):
        if not shared[i]:
            continue
        if g + gpus <= opts.gpus_per_node and (opts.cpus_per_node is None or c + cpus <= opts.cpus_per_node):
            load[i][0] += gpus
            load[i][1] += cpus
            load[i][2] += mem
            return i
    load.append([gpus, cpus, mem])
    shared.append(True)
    return len(load) - 1


def _memory_mb(role: RoleSpec) -> int | None:
    if role.resources.memory is None:
        return None
    try:
        return memory_mb(role.resources.memory)
    except ValueError as exc:
        raise ConfigError(f"role {role.name!r}: {exc}") from None


def _summary(steps: list[Step]) -> str:
    return ", ".join(f"{s.label} on node {','.join(map(str, s.nodes))}" for s in steps)


# ------------------------------------------------------------------------- script


def _sbatch_value(value: str, what: str) -> str:
    if any(c in value for c in '"\n'):
        raise ConfigError(f"{what} {value!r} must not contain double quotes or newlines")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def _export(env: dict[str, str], what: str) -> list[str]:
    lines = []
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            raise ConfigError(f"{what}: {key!r} is not a valid environment variable name")
        lines.append(f"export {key}={shlex.quote(str(value))}")
    return lines


def run_dir_of(job: JobSpec) -> str:
    return os.path.abspath(job.run_dir)


def log_path(run_dir: str, role: str, replica: int) -> str:
    """Where a role replica's output goes (all its ranks, prefixed by rank when several)."""
    return os.path.join(run_dir, "logs", f"{role}-{replica}.log")


def render_script(job: JobSpec, opts: Options) -> str:
    plan = place(job, opts)
    run_dir = run_dir_of(job)
    q = shlex.quote
    sb: list[str] = [
        f"--job-name={_sbatch_value(job.name, 'job name')}",
        f"--nodes={plan.nodes}",
        # One "task" per node holding every CPU the steps placed there use; the steps
        # then ask for their own tasks and CPUs out of it.
        "--ntasks-per-node=1",
        f"--cpus-per-task={plan.cpus_per_node}",
    ]
    if plan.gpus_per_node:
        sb.append(f"--gpus-per-node={plan.gpus_per_node}")
    mem = opts.memory or (f"{plan.mem_mb_per_node}M" if plan.mem_mb_per_node else None)
    if mem:
        sb.append(f"--mem={mem}")
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos),
                        ("time", opts.time), ("constraint", opts.constraint)):
        if value:
            sb.append(f"--{flag}={_sbatch_value(value, flag)}")
    if opts.exclusive:
        sb.append("--exclusive")
    sb.append("--requeue" if opts.requeue else "--no-requeue")
    out = os.path.join(run_dir, "logs", "slurm-%j.out")
    sb += [
        f"--output={_sbatch_value(out, 'run directory')}",
        # Append, so that a requeued run keeps the output of its earlier attempts.
        "--open-mode=append",
        # How `forge logs JOB` finds the run directory from a job id.
        f"--comment={_sbatch_value('forgerl run_dir=' + run_dir, 'run directory')}",
    ]
    sb += opts.extra_sbatch

    lines = ["#!/bin/bash", f"# forgerl job {job.name!r}: {_summary(plan.steps)}"]
    lines += [f"#SBATCH {s}" for s in sb]
    lines += ["", "set -uo pipefail"]
    lines += opts.setup
    lines += [
        f"export FORGE_RUN_DIR={q(run_dir)}",
        f"export FORGE_JOB_NAME={q(job.name)}",
        # >0 when Slurm restarted this job (requeue, preemption): the loop resumes from
        # its last checkpoint.
        "export FORGE_REQUEUED=${SLURM_RESTART_COUNT:-0}",
    ]
    lines += _export(dict(job.env), "job env")
    lines += _export(dict(opts.env), "scheduler.options.env")
    lines += [
        'FORGE_LOGS="$FORGE_RUN_DIR/logs"',
        'mkdir -p "$FORGE_LOGS"',
        'mapfile -t FORGE_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        # The batch script runs on the allocation's first node; Slurm names it so.
        'FORGE_HERE=${SLURMD_NODENAME:-$(hostname -s)}',
        'echo "forge: job $SLURM_JOB_ID attempt $FORGE_REQUEUED on ${FORGE_NODES[*]}"',
        # Exists once the primary role has ended: supervisors stop restarting their steps.
        'FORGE_STOP_FLAG=$(mktemp -u "${TMPDIR:-/tmp}/forge-stop.XXXXXX")',
        "trap 'rm -f \"$FORGE_STOP_FLAG\"' EXIT",
        "",
        _FUNCTIONS.format(ppj=PORTS_PER_JOB, base=PORT_BASE, slots=PORT_SLOTS,
                          stop_timeout=int(opts.stop_timeout + 0.999)).rstrip(),
        "",
    ]

    primaries = [s for s in plan.steps if s.role.primary] or plan.steps
    others = [s for s in plan.steps if s not in primaries]
    for step in others + primaries:
        lines += _step_block(step, opts, run_dir)
    lines += [
        "FORGE_RC=0",
        "for pid in " + " ".join(f"$PID_{_var(s)}" for s in primaries) + "; do",
        '    wait "$pid"; rc=$?',
        "    if ((rc != 0 && FORGE_RC == 0)); then FORGE_RC=$rc; fi",
        "done",
    ]
    if others:
        lines += ["forge_stop " + " ".join(f'"{s.label}:$PID_{_var(s)}"' for s in others)]
    if opts.requeue:
        lines += [_SELF_REQUEUE.strip("\n")]
    lines += [
        'echo "forge: primary role exited with status $FORGE_RC"',
        "exit $FORGE_RC",
        "",
    ]
    return "\n".join(lines)


def _var(step: Step) -> str:
    # By position: role names "a-b" and "a_b" are both allowed and must not share one.
    return str(step.index)


def _step_block(step: Step, opts: Options, run_dir: str) -> list[str]:
    q = shlex.quote
    role = step.role
    hosts = ",".join(f"${{FORGE_NODES[{i}]}}" for i in step.nodes)
    srun = [
        f"--job-name={q(job_step_name(step))}",
        f"--nodes={len(step.nodes)}",
        f'--nodelist="{hosts}"',
        f"--ntasks={step.ranks}",
        f"--ntasks-per-node={step.ranks_per_node}",
        f"--cpus-per-task={step.cpus_per_task}",
    ]
    if step.gpus_per_node:
        srun.append(f"--gpus-per-node={step.gpus_per_node}")
    if step.mem_mb:
        srun.append(f"--mem={step.mem_mb}M")
    # --exact: only the resources asked for, so steps placed on one node run side by side.
    # --kill-on-bad-exit: one failing rank ends the whole replica instead of leaving the
    # others hanging in a collective.
    srun += ["--exact", "--kill-on-bad-exit=1"]
    if step.ranks > 1:
        srun.append("--label")
    container = []
    if opts.container_image:
        container.append(f"--container-image={q(opts.container_image)}")
    if opts.container_mounts:
        container.append(f"--container-mounts={q(','.join(opts.container_mounts))}")
    if opts.container_workdir:
        container.append(f"--container-workdir={q(opts.container_workdir)}")
    if not role.command:
        raise ConfigError(f"role {role.name!r} has no command")
    # Per-task variables only exist once srun has started the task.
    wrapper = (
        "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
        f"LOCAL_WORLD_SIZE={step.ranks_per_node} NODE_RANK=$SLURM_NODEID; exec \"$@\""
    )
    cmd_lines = ["srun " + " ".join(srun)]
    if container:
        cmd_lines.append(" ".join(container))
    if opts.srun_args:
        cmd_lines.append(" ".join(q(a) for a in opts.srun_args))
    cmd_lines.append(f"bash -c {q(wrapper)} forge-task")
    command = list(role.command)
    if opts.container_image and command[0] in (sys.executable, os.path.realpath(sys.executable)):
        # This machine's interpreter path means nothing inside the image.
        command[0] = opts.container_python
    cmd_lines.append(" ".join(q(a) for a in command))

    where = ", ".join(f"node {i}" for i in step.nodes)
    block = [
        f"# {step.label}: {step.ranks} rank(s) on {where}"
        + (f", restarted up to {role.max_restarts} times" if role.max_restarts else ""),
        "(",
        f"    export FORGE_ROLE={q(role.name)} FORGE_REPLICA={step.replica}",
    ]
    block += ["    " + line for line in _export(dict(role.env), f"role {role.name!r} env")]
    if step.ranks > 1:
        master = f"${{FORGE_NODES[{step.nodes[0]}]}}"
        block += [
            f'    export MASTER_ADDR="{master}"',
            f'    export MASTER_PORT=$(forge_port {step.index} "{master}")',
        ]
    log = log_path(run_dir, role.name, step.replica)
    block += [
        f'    echo "forge: {step.label} on {hosts}"',
        f"    forge_supervise {role.max_restarts} {q(log)} \\",
        "        " + " \\\n        ".join(cmd_lines),
        ") &",
        f"PID_{_var(step)}=$!",
        "",
    ]
    return block


def job_step_name(step: Step) -> str:
    return step.label


# Exit status 143 is the trainer's "stopped by SIGTERM after checkpointing" (forgerl.worker).
# A SIGTERM that reaches the steps but not this script is a preemption notice: `scancel
# --signal=TERM`, `#SBATCH --signal=TERM@T` before the time limit. Slurm would then record
# the job as FAILED and never run it again, so the script requeues it and the next attempt
# resumes from that checkpoint. A job Slurm itself ends (scancel, scontrol requeue, a
# preemption's kill) signals this script too, which then never gets here: Slurm decides.
_SELF_REQUEUE = r"""
if ((FORGE_RC == 143)); then
    echo "forge: the trainer stopped on SIGTERM after its checkpoint; requeueing job $SLURM_JOB_ID"
    if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
    echo "forge: scontrol requeue $SLURM_JOB_ID failed; resume with forge run --resume $FORGE_RUN_DIR"
fi
"""


_FUNCTIONS = r"""
# forge_port INDEX HOST: the rendezvous port of replica INDEX. Derived from the job id so
# that two jobs sharing a node differ; when HOST is this node, moved past ports something
# already listens on (a connect that succeeds means taken).
forge_port() {{
    local port=$(( {base} + (SLURM_JOB_ID % {slots}) * {ppj} + $1 % {ppj} )) tries=0
    if [[ $2 == "$FORGE_HERE" ]]; then
        while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && ((tries++ < 100)); do
            port=$(( port + 1 ))
        done
    fi
    echo "$port"
}}

# forge_supervise RESTARTS LOG CMD...: run CMD (an srun step), appending its output to
# LOG; run it again when it fails, up to RESTARTS times, unless the job is stopping.
# SIGTERM ends it at once.
forge_supervise() {{
    local restarts=$1 log=$2 attempt=0 rc child=""
    shift 2
    trap 'trap - TERM; [[ -n $child ]] && {{ kill -TERM "$child" 2>/dev/null; wait "$child"; }}; exit 143' TERM
    while true; do
        "$@" >>"$log" 2>&1 &
        child=$!
        wait "$child"
        rc=$?
        if ((rc == 0)); then return 0; fi
        if [[ -e $FORGE_STOP_FLAG ]]; then return "$rc"; fi
        if ((attempt >= restarts)); then
            echo "forge: $FORGE_ROLE.$FORGE_REPLICA exited with status $rc"
            return "$rc"
        fi
        attempt=$((attempt + 1))
        echo "forge: $FORGE_ROLE.$FORGE_REPLICA exited with status $rc; restart $attempt of $restarts"
        sleep "${{FORGE_RESTART_DELAY:-1}}"
    done
}}

# forge_stop NAME:PID...: end the other roles. First SIGTERM to their tasks through
# Slurm (a signal to srun itself would make it kill the step at once), then {stop_timeout} s
# to exit; the supervisors of whatever is left are stopped, the rest ends with the job.
forge_stop() {{
    local item id name deadline=$((SECONDS + {stop_timeout})) ids=()
    : >"$FORGE_STOP_FLAG"
    while read -r id name; do
        for item in "$@"; do [[ ${{item%:*}} == "$name" ]] && ids+=("$id"); done
    done < <(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null)
    if ((${{#ids[@]}})); then scancel --signal=TERM "${{ids[@]}}" 2>/dev/null; fi
    for item in "$@"; do
        while kill -0 "${{item##*:}}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    done
    for item in "$@"; do kill -TERM "${{item##*:}}" 2>/dev/null; done
}}
"""
