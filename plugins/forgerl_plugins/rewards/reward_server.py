"""The server role of the ``reward_model`` reward with ``server: vllm``.

``roles(options, *, context)`` asks the scheduler to run, beside the trainer::

    python -m forgerl.server_role --run-dir RUN_DIR --role ROLE

That process loads the run's config, finds the ``reward_model`` reward whose role is
``ROLE`` and calls :func:`serve` (through ``RewardModelReward.serve``) with its options:
it starts vLLM's OpenAI server for the reward's model in pooling mode (``--runner
pooling``: a ``*ForSequenceClassification`` model serves ``/classify``) as its child,
checks one classification, and publishes the endpoint in
``<run_dir>/rewards/<ROLE>-<replica>.json`` (host, port, API key, labels) atomically; the
reward in the trainer reads it (:mod:`.reward_model_client`). All of that, the liveness
watch (a hung server is killed) and the exit status (the scheduler restarts a dead server)
are the launcher's that every served engine shares (:mod:`forgerl_plugins.serving`), as
is the vLLM command's common part: every path of the server needs the run's key
(``/classify`` sits outside the prefixes vLLM's own key check guards).

The role's name is ``reward-model-<digest>`` of what shapes the server (model, dtype,
parallelism, engine arguments, ...): two rewards with the same served model share one
server. Like the generators' launchers, this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events
from forgerl_plugins.serving import launcher, vllm_server
from forgerl_plugins.serving import roles as roles_
from forgerl_plugins.serving.vllm_server import is_cpu_build

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec
    from forgerl_plugins.rewards.reward_model_options import Options

ENDPOINT_DIR = "rewards"
SERVED_MODEL_NAME = "forge-reward-model"
DEFAULT_CPU_KV_CACHE_GB = 0.25  # scoring holds one sequence per request: little cache
HEALTH_INTERVAL = 2.0
LIVENESS_TIMEOUT = 60.0


def role_name(options: Options) -> str:
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
    return roles_.role_name("reward-model", shaping)


def endpoint_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    return launcher.endpoint_file(run_dir, role, replica, ENDPOINT_DIR)


def log_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    """Where the local scheduler writes the role's output."""
    return launcher.log_file(run_dir, role, replica)


def roles(options: Options, *, context: RunContext) -> list[RoleSpec]:
    """One vLLM pooling server when ``server: vllm``; none otherwise."""
    if options.server != "vllm":
        return []
    return [roles_.served_role(role_name(options), context, tensor_parallel_size=options.tensor_parallel_size,
                               max_restarts=options.max_restarts)]


# ------------------------------------------------------------------- the vLLM command


def server_command(options: Options, port: int) -> list[str]:
    args = vllm_server.api_server_command(
        options.model, SERVED_MODEL_NAME, options.host, port, options.dtype or "auto", options.tensor_parallel_size
    )
    # --enforce-eager: start-up in seconds; engine_args {enforce_eager: false} compiles.
    args += ["--runner", "pooling", "--enforce-eager"]
    positions = _model_positions(options.model)
    if positions is None or options.max_length < positions:
        # The reward cuts each text to this many tokens (keeping its end) before sending.
        args += ["--max-model-len", str(options.max_length)]
    args += vllm_server.kv_cache_flags(options.kv_cache_gb, DEFAULT_CPU_KV_CACHE_GB)
    return args + vllm_server.engine_arg_flags(options.engine_args)  # last: the user's own say wins


def _model_positions(model: str) -> int | None:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config.get("max_position_embeddings") or 0) or None
    except (OSError, ValueError, TypeError):
        return None  # a hub id: vLLM reads the config itself


def serve(options: Options, *, context: RunContext, role: str, replica: int) -> int:
    """Run replica ``replica`` of ``role`` (the launcher, until its server ends); the exit status."""
    run_dir = context.run_dir
    # The previous instance's file points at a dead server.
    endpoint_file(run_dir, role, replica).unlink(missing_ok=True)
    api_key = secrets.token_urlsafe(24)
    starting = events.phase(
        f"starting the reward model server for {options.model}", stage="server", run_dir=run_dir,
        key=f"reward-model-start:{'cpu' if is_cpu_build() else 'gpu'}", log=log_file(run_dir, role, replica),
    )  # fmt: skip
    plan = launcher.ServerPlan(
        role=role,
        engine="vLLM",
        host=options.host,
        startup_timeout=options.startup_timeout,
        health_interval=HEALTH_INTERVAL,
        liveness_timeout=LIVENESS_TIMEOUT,
        command=lambda port: server_command(options, port),
        env=vllm_server.server_env(options.env, api_key),
        api_key=api_key,
        first_request=first_classification,
        explain=lambda problem: f"vLLM could not classify with {options.model} ({problem})",
        endpoint={"model": SERVED_MODEL_NAME},
        endpoint_dir=ENDPOINT_DIR,
    )
    return launcher.serve(plan, run_dir, replica, starting)


def first_classification(url: str, api_key: str, timeout: float = 120.0) -> dict[str, Any] | str:
    """``{"num_labels": N}`` when one classification works, else what went wrong. A model
    that loads but is not a classifier (a causal LM) fails here, not at step 1."""
    body = {"model": SERVED_MODEL_NAME, "input": [[0]], "use_activation": False}
    try:
        answer = launcher.post_json(url + "/classify", body, api_key, timeout)
        return {"num_labels": len(answer["data"][0]["probs"])}
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode(errors="replace").strip()
        return f"HTTP {exc.code} from /classify: {detail or exc.reason}"
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
