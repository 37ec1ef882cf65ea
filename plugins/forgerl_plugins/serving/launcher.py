"""The launcher every served engine runs per replica, beside its server (the ``vllm`` and
``sglang`` generators' replicas, the served ``reward_model``).

A server role's process (:mod:`forgerl.server_role`) calls its backend's ``serve``, which
describes its engine in a :class:`ServerPlan` and calls :func:`serve`: it picks a free
port, starts the engine's server as its child, waits until it answers ``/health`` and one
first request, and then publishes the endpoint in ``<run_dir>/<endpoint_dir>/<role>-<replica>.json``
(host, port, API key, pids, what the first request learned, and an ``instance`` id that
changes on every restart), atomically; beside it, the count of liveness probes its engine
answered (:mod:`.service`: how clients tell a server back in service from one whose API
answers while its engine is wedged). The client (the generator on trainer rank 0, the
reward) finds the servers through these files: no fixed ports. A start-up failure is
written there as ``error`` (the client fails at once with it).

The launcher then watches its server through its engine (:mod:`.liveness`: a hung one is
killed; a pause the plan excuses, such as a weight update the generator announced, is not
a hang) and exits with the server's exit status (128+N when a signal killed it), so the
scheduler sees a dead server as a dead replica and restarts it. Nothing here imports an
engine or torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl import events

from . import liveness
from .service import AnswerCount

ENDPOINT_DIR = "generators"
# Variables the scheduler sets for torch.distributed rendezvous of trainer ranks; an engine
# sets up its own process group and must not pick up a rank or port meant for others.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def endpoint_file(run_dir: Path, role: str, replica: int, directory: str = ENDPOINT_DIR) -> Path:
    return Path(run_dir) / directory / f"{role}-{replica}.json"


def log_file(run_dir: Path, role: str, replica: int) -> Path:
    """Where the local scheduler writes a replica's output (``logs/<role>-<replica>.log``)."""
    return Path(run_dir) / "logs" / f"{role}-{replica}.log"


def server_env(options_env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: ours without the trainer's rendezvous variables, then
    the user's ``env`` option; the engine's own variables go on top."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(options_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cli_flags(arguments: Mapping[str, Any], *, negative: bool) -> list[str]:
    """An engine's command-line flags for ``arguments`` (``{max_num_seqs: 8}`` →
    ``--max-num-seqs 8``): true is the bare flag; false is ``--no-<flag>`` where the engine
    spells it so (``negative``: vLLM) and nothing otherwise (SGLang); None is nothing."""
    out: list[str] = []
    for key, value in arguments.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False and negative:
            out.append("--no-" + flag[2:])
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(bind_host: str) -> str:
    """The address clients use for a server bound to ``bind_host``."""
    if bind_host in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind_host


def healthy(url: str, timeout: float = 5.0, api_key: str | None = None) -> bool:
    """The server answers ``/health`` (with our key, where the server guards it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url + "/health", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def write_endpoint(path: Path, data: dict[str, Any]) -> None:
    """Atomically, readable by the owner only (it holds the API key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def die_with_parent() -> None:
    """In the child: SIGKILL when the launcher dies, so no server outlives its replica."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop(child: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM first: the server then stops its engine processes too; past ``grace``,
    SIGKILL for the server and every process below it."""
    child.terminate()
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        liveness.kill_tree(child.pid)
        child.wait()


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def exit_status(code: int) -> int:
    # Popen reports death by signal N as -N; a shell reports 128+N.
    return 128 - code if code < 0 else code


@dataclass
class ServerPlan:
    """What :func:`serve` needs to know about one engine's server."""

    role: str  # endpoint and log file names: "vllm", "sglang", "reward-model-<digest>"
    engine: str  # in messages: "vLLM", "SGLang"
    host: str
    startup_timeout: float
    health_interval: float
    liveness_timeout: float
    command: Callable[[int], list[str]]  # the server's argv for a port
    env: dict[str, str]
    api_key: str
    #: ``first_request(url, api_key)``: None when one tiny request works (or what it taught
    #: for the endpoint file, such as a classifier's ``num_labels``), else what failed.
    first_request: Callable[[str, str], str | dict[str, Any] | None]
    #: Rewrites what failed in the first request into advice (default: as it is).
    explain: Callable[[str], str] | None = None
    #: More fields of the endpoint file (the served model name, ...).
    endpoint: dict[str, Any] = field(default_factory=dict)
    #: The run directory's folder for the endpoint file (the served reward model: "rewards").
    endpoint_dir: str = ENDPOINT_DIR
    #: ``engine_probe(url, api_key)`` → the liveness probe (``probe(timeout) -> alive``)
    #: that goes through the engine (see :mod:`.liveness`); None: ``/health`` alone. A
    #: probe with an ``answered`` attribute says by it whether its last success was an
    #: answer of the engine, not only a pass between spaced probes: only answers are
    #: counted for the clients (:mod:`.service`).
    engine_probe: Callable[[str, str], Callable[[float], bool]] | None = None
    #: What the probe asks, for the message when it kills the server.
    probe_name: str = "/health"
    #: ``paused(endpoint_file, instance)`` → whether the server's engine is paused on
    #: purpose right now (a generator's weight update), which excuses its silence; None:
    #: it never is.
    paused: Callable[[Path, str], Callable[[], bool]] | None = None


def serve(plan: ServerPlan, run_dir: Path, replica: int, starting: Any) -> int:
    """Start, publish and watch one server (see the module docstring); the exit status.
    ``starting``: the ``events.phase`` that ends once the server is ready."""
    endpoint = endpoint_file(run_dir, plan.role, replica, plan.endpoint_dir)
    child: subprocess.Popen | None = None
    stopping: list[int] = []

    def say(message: str) -> None:
        print(f"forge {plan.role} launcher: {message}", flush=True)

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    port = 0
    for attempt in range(3):
        port = free_port(plan.host)
        say(f"replica {replica}: starting {plan.engine} on {plan.host}:{port}")
        child = subprocess.Popen(  # noqa: PLW1509 - prctl only, no Python in between
            plan.command(port), env=plan.env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        url = f"http://{connect_host(plan.host)}:{port}"
        deadline = time.monotonic() + plan.startup_timeout
        while child.poll() is None and not stopping and time.monotonic() < deadline:
            if healthy(url, api_key=plan.api_key):
                break
            time.sleep(0.5)
        if stopping:
            return _wait(child, endpoint)
        if child.poll() is None and time.monotonic() >= deadline:
            stop(child)
            return failed(endpoint, f"{plan.engine} was not healthy after {plan.startup_timeout:g} s")
        if child.poll() is not None:
            # Someone took the port between our probe and the server's bind: try another.
            if attempt < 2 and not port_free(plan.host, port):
                say(f"replica {replica}: port {port} was taken; retrying on another")
                continue
            return failed(
                endpoint,
                f"{plan.engine} exited with status {exit_status(child.returncode)} before it was healthy",
            )
        break
    assert child is not None
    url = f"http://{connect_host(plan.host)}:{port}"
    # Healthy is not enough: some models load and then fail at the first forward pass.
    answer = plan.first_request(url, plan.api_key)
    if isinstance(answer, str):
        stop(child)
        return failed(
            endpoint,
            plan.explain(answer) if plan.explain else f"{plan.engine} failed its first request ({answer})",
        )
    instance = uuid.uuid4().hex
    # Before the endpoint: a client that finds the server finds its count too.
    answers = AnswerCount(endpoint, instance)
    answers.publish()
    write_endpoint(
        endpoint,
        {
            "replica": replica,
            "instance": instance,
            "host": connect_host(plan.host),
            "port": port,
            "api_key": plan.api_key,
            **plan.endpoint,
            **(answer or {}),
            "pid": child.pid,
            "launcher_pid": os.getpid(),
            "started": time.time(),
        },
    )
    say(f"replica {replica}: healthy at {url} (pid {child.pid}); endpoint in {endpoint}")
    starting.done()
    if plan.engine_probe is not None:
        probe = plan.engine_probe(url, plan.api_key)
    else:
        probe = lambda timeout: healthy(url, timeout, plan.api_key)  # noqa: E731

    def counted(timeout: float) -> bool:
        alive = probe(timeout)
        if alive and getattr(probe, "answered", True):  # not a pass between spaced probes
            answers.add()
        return alive

    try:
        hung = liveness.watch(
            child,
            counted,
            interval=plan.health_interval,
            timeout=plan.liveness_timeout,
            stopping=lambda: bool(stopping),
            excused=plan.paused(endpoint, instance) if plan.paused else lambda: False,
            what=plan.probe_name,
        )
    finally:
        endpoint.unlink(missing_ok=True)
        answers.remove()
    if hung:
        say(f"replica {replica}: {hung}")
        return 1  # a failure: the scheduler restarts the replica
    return exit_status(child.returncode)


def post_json(url: str, body: dict[str, Any], api_key: str, timeout: float) -> Any:
    """POST ``body`` with the run's key; the decoded answer (raises urllib's errors)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def failed(endpoint: Path, why: str) -> int:
    """Tell the generator (it fails at once with this message) and exit non-zero."""
    role = endpoint.stem.rsplit("-", 1)[0]
    print(f"forge {role} launcher: {why}", flush=True)
    write_endpoint(endpoint, {"error": why, "launcher_pid": os.getpid(), "time": time.time()})
    run_dir = endpoint.parent.parent
    replica = endpoint.stem.rsplit("-", 1)[-1]
    events.announce(why, stage="server", state="failed", run_dir=run_dir,
                    log=log_file(run_dir, role, int(replica)) if replica.isdigit() else None)  # fmt: skip
    return 1


def _wait(child: subprocess.Popen, endpoint: Path) -> int:
    try:
        code = child.wait()
    finally:
        endpoint.unlink(missing_ok=True)
    return exit_status(code)
