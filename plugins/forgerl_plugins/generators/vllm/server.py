"""The server role of the ``vllm`` generator: one launcher process per replica.

``roles(options, *, context)`` tells the scheduler to run ``replicas`` copies of::

    python -m forgerl.server_role --run-dir RUN_DIR --role vllm

Each copy (its replica index comes from ``FORGE_REPLICA``, which every scheduler sets)
loads the run's config, prepares the run's model exactly as the trainer does, and calls
:func:`serve` (through ``VLLMGenerator.serve``), which runs vLLM's OpenAI server through the
launcher all served engines share (:mod:`forgerl_plugins.serving.launcher`: free port,
health, first request, the endpoint file ``<run_dir>/generators/vllm-<replica>.json``,
liveness, exit status). It imports neither vLLM nor torch: it only spawns them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events
from forgerl.images import ImageLimits
from forgerl.images.render import is_vision_folder
from forgerl_plugins.generators.common.update_notice import NoticeReader
from forgerl_plugins.serving import launcher, vllm_server
from forgerl_plugins.serving.vllm_server import engine_arg_flags, is_cpu_build

from . import cpu_cores
from .images import SERVER_FLAG as IMAGE_SERVER_FLAG

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.adapters import LoraOptions
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec

    from .options import Options

ROLE = "vllm"
#: The name under which every replica serves the policy (requests name it as "model").
SERVED_MODEL_NAME = "forge-policy"
WORKER_EXTENSION = "forgerl_plugins.generators.vllm.worker_extension.ForgeWorkerExtension"
#: The trainer's logprob contract (log_softmax(logits / T) at the sampled token) is what
#: vLLM calls "processed" logprobs: after temperature scaling. "raw" would ignore T.
LOGPROBS_MODE = "processed_logprobs"
DEFAULT_CPU_KV_CACHE_GB = 1.0


def endpoint_file(run_dir: Path, replica: int) -> Path:
    return launcher.endpoint_file(run_dir, ROLE, replica)


def log_file(run_dir: Path, replica: int) -> Path:
    """Where the local scheduler writes the replica's output (``logs/<role>-<replica>.log``)."""
    return launcher.log_file(run_dir, ROLE, replica)


# ----------------------------------------------------------------------------- the role


def roles(options: Options, *, context: RunContext) -> list[RoleSpec]:
    """The server role the scheduler starts beside the trainer."""
    from forgerl.rundirs.runs import server_role_command
    from forgerl.types import Resources, RoleSpec

    cpu = is_cpu_build()
    return [
        RoleSpec(
            name=ROLE,
            command=server_role_command(context.run_dir, ROLE),
            replicas=options.replicas,
            resources=Resources(cpus=1, gpus=0 if cpu else options.tensor_parallel_size),
            max_restarts=options.max_restarts,
        )
    ]


# ------------------------------------------------------------------- the vLLM command


def server_command(
    options: Options, model_dir: Path, model_dtype: str, port: int, adapter: LoraOptions | None = None
) -> list[str]:
    """vLLM's OpenAI server for ``model_dir`` on ``options.host:port`` with our options
    (and LoRA on, for the trainer's ``adapter``)."""
    dtype = model_dtype if options.dtype == "auto" else options.dtype
    args = vllm_server.api_server_command(
        str(model_dir), SERVED_MODEL_NAME, options.host, port, dtype, options.tensor_parallel_size
    )
    args += ["--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", LOGPROBS_MODE]
    if options.max_model_len is not None:
        args += ["--max-model-len", str(options.max_model_len)]
    if options.enforce_eager:
        args.append("--enforce-eager")
    if adapter is not None:
        args += adapter_flags(adapter, options.max_adapters)
    if is_vision_folder(model_dir):
        # Our token ids with their images go through the tokens-in endpoint (.images).
        args += [IMAGE_SERVER_FLAG, "--limit-mm-per-prompt", json.dumps({"image": ImageLimits().max_images})]
    # vLLM's CPU default reserves most of the machine's memory; one GiB holds ~100k tokens
    # of a 135M model.
    args += vllm_server.kv_cache_flags(options.kv_cache_gb, DEFAULT_CPU_KV_CACHE_GB)
    if is_cpu_build() and options.send_seed:
        args += engine_arg_flags(whole_prefill_args(options, model_dir))
    args += engine_arg_flags(options.engine_args)  # last: the user's own say wins
    return args


def adapter_flags(adapter: LoraOptions, slots: int = 1) -> list[str]:
    """LoRA on, for ``slots`` adapters at once (a run's one, or a fleet's runs'): vLLM
    sizes its adapter slots by ``--max-lora-rank``, which takes only some values (the
    smallest that holds the rank)."""
    fits = [r for r in MAX_LORA_RANKS if r >= adapter.rank]
    n = str(slots)
    return ["--enable-lora", "--max-loras", n, "--max-cpu-loras", n, "--max-lora-rank", str(fits[0])]


#: The ``--max-lora-rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def whole_prefill_args(options: Options, model_dir: Path) -> dict[str, Any]:
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


def server_env(options: Options, api_key: str, adapter: LoraOptions | None = None) -> dict[str, str]:
    env = vllm_server.server_env(options.env, api_key)
    # /collective_rpc, /pause, /resume and /reset_prefix_cache exist only in dev mode (the
    # guard, vllm_auth, makes them need the run's key like every other path).
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if adapter is not None:
        # /v1/load_lora_adapter, through which the generator names the adapter once per
        # server (also behind the run's key).
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return env


# ----------------------------------------------------------------------- the launcher


def serve(options: Options, *, context: RunContext, role: str, replica: int) -> int:
    """Run replica ``replica`` of the role (the launcher, until its server ends); the exit status."""
    run_dir, model_dir = context.run_dir, context.model_path
    assert model_dir is not None, "forgerl.server_role prepares a generator's model"
    # A file left by the previous instance of this replica points at a dead server.
    endpoint_file(run_dir, replica).unlink(missing_ok=True)
    api_key = secrets.token_urlsafe(24)
    env = server_env(options, api_key, context.adapter)
    if is_cpu_build():
        env.update(cpu_cores.binding_env(context.max_staleness, options.env, os.environ))
    starting = events.phase(
        "starting the vLLM server", detail="loading the model, then one first request",
        stage="server", key=f"vllm-start:{context.model_name}:{'cpu' if is_cpu_build() else 'gpu'}",
        run_dir=run_dir, log=log_file(run_dir, replica),
    )  # fmt: skip
    plan = launcher.ServerPlan(
        role=ROLE,
        engine="vLLM",
        host=options.host,
        startup_timeout=options.startup_timeout,
        health_interval=options.health_interval,
        liveness_timeout=options.liveness_timeout,
        command=lambda port: server_command(options, model_dir, context.dtype, port, context.adapter),
        env=env,
        api_key=api_key,
        first_request=first_request,
        explain=explain_first_failure,
        endpoint={"model": SERVED_MODEL_NAME},
        engine_probe=functools.partial(EngineProbe, spacing=options.liveness_timeout / 4),
        probe_name="its engine (no token made, and no one-token completion)",
        paused=lambda endpoint, instance: NoticeReader(endpoint, instance).updating,
    )
    return launcher.serve(plan, run_dir, replica, starting)


def explain_first_failure(problem: str) -> str:
    head = re.search(r"Unsupported CPU attention configuration: head_dim=(\d+)", problem)
    if head:  # say what to do first: the scheduler shows only the start of this line
        return (
            f"vLLM's CPU attention has no kernels for this model's {head.group(1)}-wide heads (it needs "
            f"32 or more): serve a model with wider heads, or use --generator hf ({problem})"
        )
    return f"vLLM failed its first request ({problem})"


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


#: The counters of tokens vLLM's engine processed (``/metrics``, summed over engines).
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class EngineProbe:
    """The launcher's liveness probe of one vLLM server, through its engine.

    vLLM's ``/health`` answers from the API server process without asking the engine core,
    so it stays 200 while the engine core or a worker is stuck. The engine is alive when
    its token counters moved since the last probe (a busy engine, whose queue a probe
    would wait in), or else a one-token completion answers within the probe's deadline
    (an idle one). Our own probe's tokens are not counted as progress."""

    def __init__(self, url: str, api_key: str, *, spacing: float = 0.0) -> None:
        self.url = url
        self.api_key = api_key
        #: Seconds between two one-token completions. On a CPU build a completion keeps the
        #: engine's threads busy on every core: one at each health check (every 0.5-2 s)
        #: starved a second replica starting on the same cores for minutes. Between
        #: completions the engine counts as alive as of the last one that answered, so a
        #: wedge is still found within ``liveness_timeout`` plus this spacing.
        self.spacing = spacing
        self.seen: float | None = None  # the counters at the last probe
        self.answered_at: float | None = None  # when a one-token completion last answered
        #: Whether the last probe that passed heard from the engine (its counters moved, or
        #: a completion answered), not only fell within the spacing: the launcher counts
        #: those answers for the clients (forgerl_plugins.serving.service).
        self.answered = False

    def __call__(self, timeout: float) -> bool:
        self.answered = True
        made = tokens_processed(self.url, self.api_key, timeout)
        if made is not None:
            progressed = self.seen is not None and made > self.seen
            self.seen = made
            if progressed:
                return True
        if self.answered_at is not None and time.monotonic() - self.answered_at < self.spacing:
            self.answered = False
            return True
        answered = one_token(self.url, self.api_key, timeout)
        if answered:
            self.answered_at = time.monotonic()
            if self.seen is not None:
                self.seen += 2  # the probe's prompt token and its generated token
        return answered


def tokens_processed(url: str, api_key: str, timeout: float) -> float | None:
    """The sum of vLLM's token counters, or None where ``/metrics`` has none (stats off)."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    total, found = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in TOKEN_COUNTERS:
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return total if found else None


def one_token(url: str, api_key: str, timeout: float) -> bool:
    """A one-token completion through the engine answered within ``timeout``."""
    body = {"model": SERVED_MODEL_NAME, "prompt": [0], "max_tokens": 1}
    try:
        launcher.post_json(url + "/v1/completions", body, api_key, timeout)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


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
