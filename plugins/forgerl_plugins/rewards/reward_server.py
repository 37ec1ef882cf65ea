"""The server role of the ``reward_model`` reward with ``server: vllm``.

``roles(options, *, context)`` asks the scheduler to run, beside the trainer::

    python -m forgerl_plugins.rewards.reward_server --run-dir RUN_DIR --role ROLE

The launcher finds in the run's config.yaml the ``reward_model`` reward whose role is
``ROLE``, starts vLLM's OpenAI server for its model in pooling mode (``--runner pooling``:
a ``*ForSequenceClassification`` model serves ``/classify``) as its child, checks one
classification, and publishes the endpoint in ``<run_dir>/rewards/<ROLE>-<replica>.json``
(host, port, API key, labels) atomically; the reward in the trainer reads it
(:mod:`.reward_model_client`). The launcher exits with the server's status, so the
scheduler restarts a dead server; a hung one (``/health`` silent) is killed as the vllm
generator's launcher does. Every path of the server needs the run's key (the generator's
middleware): ``/classify`` sits outside the prefixes vLLM's own key check guards.

The role's name is ``reward-model-<digest>`` of what shapes the server (model, dtype,
parallelism, engine arguments, ...): two rewards with the same served model share one
server. Like the generator's launcher, this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl import events
from forgerl_plugins.generators.common import liveness
from forgerl_plugins.generators.common.launcher import connect_host, free_port, healthy, write_endpoint
from forgerl_plugins.generators.vllm.auth import KEY_ENV, MIDDLEWARE
from forgerl_plugins.generators.vllm.server import engine_arg_flags, is_cpu_build

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec
    from forgerl_plugins.rewards.options import RewardModelOptions

ENDPOINT_DIR = "rewards"
SERVED_MODEL_NAME = "forge-reward-model"
DEFAULT_CPU_KV_CACHE_GB = 0.25  # scoring holds one sequence per request: little cache
HEALTH_INTERVAL = 2.0
LIVENESS_TIMEOUT = 60.0
#: The scheduler's torch.distributed variables are the trainer's, not vLLM's.
_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def role_name(options: RewardModelOptions) -> str:
    """The role serving these options' model; equal options give equal names."""
    shaping = {
        "model": options.model,
        "dtype": options.dtype,
        "max_length": options.max_length,
        "tensor_parallel_size": options.tensor_parallel_size,
        "host": options.host,
        "kv_cache_gb": options.kv_cache_gb,
        "env": options.env,
        "engine_args": options.engine_args,
        "max_restarts": options.max_restarts,
    }
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"reward-model-{digest}"


def endpoint_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    return Path(run_dir) / ENDPOINT_DIR / f"{role}-{replica}.json"


def log_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    """Where the local scheduler writes the role's output."""
    return Path(run_dir) / "logs" / f"{role}-{replica}.log"


def roles(options: RewardModelOptions, *, context: RunContext) -> list[RoleSpec]:
    """One vLLM pooling server when ``server: vllm``; none otherwise."""
    from forgerl.types import Resources, RoleSpec

    if options.server != "vllm":
        return []
    name = role_name(options)
    command = (
        sys.executable,
        "-m",
        "forgerl_plugins.rewards.reward_server",
        "--run-dir",
        str(context.run_dir),
    )
    return [
        RoleSpec(
            name=name,
            command=(*command, "--role", name),
            resources=Resources(cpus=1, gpus=0 if is_cpu_build() else options.tensor_parallel_size),
            max_restarts=options.max_restarts,
        )
    ]


# ------------------------------------------------------------------- the vLLM command


def server_command(options: RewardModelOptions, port: int) -> list[str]:
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", options.model,
        "--served-model-name", SERVED_MODEL_NAME,
        "--runner", "pooling",
        "--host", options.host,
        "--port", str(port),
        "--dtype", options.dtype or "auto",
        "--tensor-parallel-size", str(options.tensor_parallel_size),
        "--enforce-eager",  # start-up in seconds; engine_args {enforce_eager: false} compiles
        "--disable-uvicorn-access-log",
        "--middleware", MIDDLEWARE,
    ]  # fmt: skip
    positions = _model_positions(options.model)
    if positions is None or options.max_length < positions:
        # The reward cuts each text to this many tokens (keeping its end) before sending.
        args += ["--max-model-len", str(options.max_length)]
    kv_gb = options.kv_cache_gb
    if kv_gb is None and is_cpu_build() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_gb = DEFAULT_CPU_KV_CACHE_GB  # vLLM's CPU default takes most of the machine's memory
    if kv_gb is not None:
        args += ["--kv-cache-memory-bytes", str(int(kv_gb * 2**30))]
    return args + engine_arg_flags(options.engine_args)  # last: the user's own say wins


def _model_positions(model: str) -> int | None:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config.get("max_position_embeddings") or 0) or None
    except (OSError, ValueError, TypeError):
        return None  # a hub id: vLLM reads the config itself


def server_env(options: RewardModelOptions, api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(options.env)
    env[KEY_ENV] = api_key  # in the environment, where `ps` does not show it
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ----------------------------------------------------------------------- the launcher


def _say(message: str) -> None:
    print(f"forge reward model launcher: {message}", flush=True)


def find_options(run_dir: Path, role: str) -> RewardModelOptions | None:
    """The options of the run's reward_model reward served by ``role``."""
    import yaml

    from forgerl import runs
    from forgerl.config import validate_config
    from forgerl_plugins.rewards.options import RewardModelOptions

    config = validate_config(yaml.safe_load((run_dir / runs.CONFIG_FILE).read_text()), source=str(run_dir))
    for choice in config.rewards:
        if choice.name != "reward_model":
            continue
        options = RewardModelOptions.model_validate(choice.options)
        if options.server == "vllm" and role_name(options) == role:
            return options
    return None


def launch(run_dir: Path, role: str, replica: int) -> int:
    endpoint = endpoint_file(run_dir, role, replica)
    endpoint.unlink(missing_ok=True)  # the previous instance's file points at a dead server
    options = find_options(run_dir, role)
    if options is None:
        return _failed(
            endpoint, f"no reward_model reward with server: vllm in the run's config has role {role!r}"
        )
    api_key = secrets.token_urlsafe(24)
    env = server_env(options, api_key)
    child: subprocess.Popen | None = None
    stopping: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    starting = events.phase(
        f"starting the reward model server for {options.model}", stage="server", run_dir=run_dir,
        key=f"reward-model-start:{'cpu' if is_cpu_build() else 'gpu'}", log=log_file(run_dir, role, replica),
    )  # fmt: skip
    port = free_port(options.host)
    url = f"http://{connect_host(options.host)}:{port}"
    _say(f"starting vLLM (pooling) on {options.host}:{port} for {options.model}")
    child = subprocess.Popen(  # noqa: PLW1509 - the preexec only sets the parent-death signal
        server_command(options, port), env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
    )
    deadline = time.monotonic() + options.startup_timeout
    while child.poll() is None and not stopping and time.monotonic() < deadline:
        if healthy(url, api_key=api_key):
            break
        time.sleep(0.5)
    if stopping:
        return _status(child.wait())
    if child.poll() is not None:
        return _failed(endpoint, f"vLLM exited with status {_status(child.returncode)} before it was healthy")
    if time.monotonic() >= deadline:
        _stop(child)
        return _failed(endpoint, f"vLLM was not healthy after {options.startup_timeout:g} s")
    labels, problem = first_classification(url, api_key)
    if problem is not None:
        _stop(child)
        return _failed(endpoint, f"vLLM could not classify with {options.model} ({problem})")
    write_endpoint(
        endpoint,
        {
            "instance": uuid.uuid4().hex,
            "host": connect_host(options.host),
            "port": port,
            "api_key": api_key,
            "model": SERVED_MODEL_NAME,
            "num_labels": labels,
            "pid": child.pid,
            "launcher_pid": os.getpid(),
            "started": time.time(),
        },
    )
    _say(f"healthy at {url} (pid {child.pid}, {labels} label(s)); endpoint in {endpoint}")
    starting.done()
    try:
        hung = liveness.watch(
            child,
            lambda timeout: healthy(url, timeout, api_key),
            interval=HEALTH_INTERVAL,
            timeout=LIVENESS_TIMEOUT,
            stopping=lambda: bool(stopping),
        )
    finally:
        endpoint.unlink(missing_ok=True)
    if hung:
        _say(hung)
        return 1
    return _status(child.returncode)


def first_classification(url: str, api_key: str, timeout: float = 120.0) -> tuple[int, str | None]:
    """(number of labels, None) when one classification works, else (0, what went wrong).
    A model that loads but is not a classifier (a causal LM) fails here, not at step 1."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "input": [[0]], "use_activation": False}).encode()
    request = urllib.request.Request(
        url + "/classify",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return len(json.loads(r.read())["data"][0]["probs"]), None
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode(errors="replace").strip()
        return 0, f"HTTP {exc.code} from /classify: {detail or exc.reason}"
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def _failed(endpoint: Path, why: str) -> int:
    """Tell the reward (it stops waiting with this message) and exit non-zero."""
    _say(why)
    write_endpoint(endpoint, {"error": why, "launcher_pid": os.getpid(), "time": time.time()})
    events.announce(why, stage="server", state="failed", run_dir=endpoint.parent.parent)
    return 1


def _die_with_parent() -> None:
    """In the child: SIGKILL when the launcher dies, so no server outlives its role."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop(child: subprocess.Popen, grace: float = 15.0) -> None:
    child.terminate()  # vLLM's API server stops its engine processes on SIGTERM
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        liveness.kill_tree(child.pid)
        child.wait()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # Popen's -N for signal N, as a shell says it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgerl_plugins.rewards.reward_server")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--role", required=True)
    args = parser.parse_args(argv)
    replica = int(os.environ.get("FORGE_REPLICA", "0"))
    return launch(args.run_dir.resolve(), args.role, replica)


if __name__ == "__main__":
    sys.exit(main())
