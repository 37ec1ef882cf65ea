"""The server role of the ``reward_model`` reward with ``server: vllm``.

``roles(options, *, context)`` asks the scheduler to run, beside the trainer::

    python -m forgerl_plugins.rewards.reward_server --run-dir RUN_DIR --role ROLE

The launcher finds in the run's config.yaml the ``reward_model`` reward whose role is
``ROLE``, starts vLLM's OpenAI server for its model in pooling mode (``--runner pooling``:
a ``*ForSequenceClassification`` model serves ``/classify``) as its child, checks one
classification, and publishes the endpoint in ``<run_dir>/rewards/<ROLE>-<replica>.json``
(host, port, API key, labels) atomically; the reward in the trainer reads it
(:mod:`.reward_model_client`). All of that, the liveness watch (a hung server is killed)
and the exit status (the scheduler restarts a dead server) are the server generators'
launcher's (:func:`forgerl_plugins.generators.common.launcher.serve`). Every path of the server needs the run's key (the generator's
middleware): ``/classify`` sits outside the prefixes vLLM's own key check guards.

The role's name is ``reward-model-<digest>`` of what shapes the server (model, dtype,
parallelism, engine arguments, ...): two rewards with the same served model share one
server. Like the generator's launcher, this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import urllib.error
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events
from forgerl_plugins.generators.common import launcher
from forgerl_plugins.generators.vllm.auth import KEY_ENV, MIDDLEWARE
from forgerl_plugins.generators.vllm.server import engine_arg_flags, is_cpu_build

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec
    from forgerl_plugins.rewards.reward_model import RewardModelReward

ENDPOINT_DIR = "rewards"
MODULE = "forgerl_plugins.rewards.reward_server"
SERVED_MODEL_NAME = "forge-reward-model"
DEFAULT_CPU_KV_CACHE_GB = 0.25  # scoring holds one sequence per request: little cache
HEALTH_INTERVAL = 2.0
LIVENESS_TIMEOUT = 60.0


def role_name(options: RewardModelReward.Options) -> str:
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
    return launcher.endpoint_file(run_dir, role, replica, ENDPOINT_DIR)


def log_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    """Where the local scheduler writes the role's output."""
    return launcher.log_file(run_dir, role, replica)


def roles(options: RewardModelReward.Options, *, context: RunContext) -> list[RoleSpec]:
    """One vLLM pooling server when ``server: vllm``; none otherwise."""
    from forgerl.types import Resources, RoleSpec

    if options.server != "vllm":
        return []
    name = role_name(options)
    return [
        RoleSpec(
            name=name,
            command=launcher.launcher_command(MODULE, context.run_dir, "--role", name),
            resources=Resources(cpus=1, gpus=0 if is_cpu_build() else options.tensor_parallel_size),
            max_restarts=options.max_restarts,
        )
    ]


# ------------------------------------------------------------------- the vLLM command


def server_command(options: RewardModelReward.Options, port: int) -> list[str]:
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


def server_env(options: RewardModelReward.Options, api_key: str) -> dict[str, str]:
    env = launcher.server_env(options.env)
    env[KEY_ENV] = api_key  # in the environment, where `ps` does not show it
    return env


# ----------------------------------------------------------------------- the launcher


def find_options(run_dir: Path, role: str) -> RewardModelReward.Options | None:
    """The options of the run's reward_model reward served by ``role``."""
    import yaml

    from forgerl import runs
    from forgerl.config import validate_config
    from forgerl_plugins.rewards.reward_model import RewardModelReward

    config = validate_config(yaml.safe_load((run_dir / runs.CONFIG_FILE).read_text()), source=str(run_dir))
    for choice in config.rewards:
        if choice.name != "reward_model":
            continue
        options = RewardModelReward.Options.model_validate(choice.options)
        if options.server == "vllm" and role_name(options) == role:
            return options
    return None


def launch(run_dir: Path, role: str, replica: int) -> int:
    endpoint = endpoint_file(run_dir, role, replica)
    endpoint.unlink(missing_ok=True)  # the previous instance's file points at a dead server
    options = find_options(run_dir, role)
    if options is None:
        return launcher.failed(
            endpoint, f"no reward_model reward with server: vllm in the run's config has role {role!r}"
        )
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
        env=server_env(options, api_key),
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


def main(argv: list[str] | None = None) -> int:
    args = launcher.launcher_args(MODULE, argv, "--role")
    return launch(args.run_dir, args.role, args.replica)


if __name__ == "__main__":
    sys.exit(main())
