"""The server role of the ``model`` teacher with ``server: vllm``.

``roles(options, *, context)`` asks the scheduler to run, beside the trainer::

    python -m forgerl.server_role --run-dir RUN_DIR --role ROLE

That process loads the run's config, finds the teacher whose role is ``ROLE`` and calls
:func:`serve` (through ``ModelTeacher.serve``): it resolves the teacher's model to a local
folder (a named model is built on first use, as the trainer builds the student), starts
vLLM's OpenAI server for it as its child, checks that one prompt-logprobs request works,
and publishes the endpoint in ``<run_dir>/teachers/<ROLE>-<replica>.json`` atomically; the
teacher in the trainer reads it (:mod:`.client`). The launcher, the liveness watch (a hung
server is killed), the exit status (the scheduler restarts a dead server) and the key that
guards every path are those every served engine shares (:mod:`forgerl_plugins.serving`).

The role's name is ``teacher-<digest>`` of what shapes the server. Like the other
launchers, this module imports neither vLLM nor torch.
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

    from .options import Options

ENDPOINT_DIR = "teachers"
SERVED_MODEL_NAME = "forge-teacher"
#: The teacher holds a step's sequences at once; a little more than the reward model's.
DEFAULT_CPU_KV_CACHE_GB = 0.5
HEALTH_INTERVAL = 2.0
LIVENESS_TIMEOUT = 60.0


def role_name(options: Options) -> str:
    """The role serving these options' model; equal options give equal names."""
    shaping = {
        "model": options.model,
        "model_options": options.model_options,
        "dtype": options.dtype,
        "tensor_parallel_size": options.tensor_parallel_size,
        "host": options.host,
        "kv_cache_gb": options.kv_cache_gb,
        "env": options.env,
        "engine_args": options.engine_args,
        "max_restarts": options.max_restarts,
    }
    return roles_.role_name("teacher", shaping)


def endpoint_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    return launcher.endpoint_file(run_dir, role, replica, ENDPOINT_DIR)


def log_file(run_dir: Path, role: str, replica: int = 0) -> Path:
    """Where the local scheduler writes the role's output."""
    return launcher.log_file(run_dir, role, replica)


def roles(options: Options, *, context: RunContext) -> list[RoleSpec]:
    """One vLLM server when ``server: vllm``; none otherwise."""
    if options.server != "vllm":
        return []
    return [roles_.served_role(role_name(options), context, tensor_parallel_size=options.tensor_parallel_size,
                               max_restarts=options.max_restarts)]


def server_command(options: Options, folder: Path, port: int) -> list[str]:
    args = vllm_server.api_server_command(
        str(folder), SERVED_MODEL_NAME, options.host, port, options.dtype or "auto", options.tensor_parallel_size
    )
    # --enforce-eager: start-up in seconds; engine_args {enforce_eager: false} compiles.
    args += ["--enforce-eager"]
    args += vllm_server.kv_cache_flags(options.kv_cache_gb, DEFAULT_CPU_KV_CACHE_GB)
    return args + vllm_server.engine_arg_flags(options.engine_args)  # last: the user's own say wins


def serve(options: Options, *, context: RunContext, role: str, replica: int) -> int:
    """Run replica ``replica`` of ``role`` (the launcher, until its server ends); the exit status."""
    from .options import teacher_folder

    run_dir = context.run_dir
    # The previous instance's file points at a dead server.
    endpoint_file(run_dir, role, replica).unlink(missing_ok=True)
    with events.phase(f"preparing teacher model {options.model}", stage="model",
                      key=f"model:{options.model}", run_dir=run_dir):  # fmt: skip
        folder = teacher_folder(options)
    api_key = secrets.token_urlsafe(24)
    starting = events.phase(
        f"starting the teacher's server for {options.model}", stage="server", run_dir=run_dir,
        key=f"teacher-start:{'cpu' if is_cpu_build() else 'gpu'}", log=log_file(run_dir, role, replica),
    )  # fmt: skip
    plan = launcher.ServerPlan(
        role=role,
        engine="vLLM",
        host=options.host,
        startup_timeout=options.startup_timeout,
        health_interval=HEALTH_INTERVAL,
        liveness_timeout=LIVENESS_TIMEOUT,
        command=lambda port: server_command(options, folder, port),
        env=vllm_server.server_env(options.env, api_key),
        api_key=api_key,
        first_request=first_scoring,
        explain=lambda problem: f"vLLM could not score prompt logprobs with {options.model} ({problem})",
        endpoint={"model": SERVED_MODEL_NAME},
        endpoint_dir=ENDPOINT_DIR,
    )
    return launcher.serve(plan, run_dir, replica, starting)


def first_scoring(url: str, api_key: str, timeout: float = 120.0) -> dict[str, Any] | str | None:
    """None when one prompt-logprobs request works, else what went wrong: a model that
    loads but cannot score fails here, not at the first step."""
    body = {"model": SERVED_MODEL_NAME, **completion_body([[0, 1]])}
    try:
        answer = launcher.post_json(url + "/v1/completions", body, api_key, timeout)
        positions = answer["choices"][0]["prompt_logprobs"]
        if not isinstance(positions, list) or len(positions) != 2 or not positions[1]:
            return f"no prompt_logprobs in the answer: {json.dumps(answer)[:200]}"
        return None
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode(errors="replace").strip()
        return f"HTTP {exc.code} from /v1/completions: {detail or exc.reason}"
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def completion_body(prompts: list[list[int]]) -> dict[str, Any]:
    """The request that asks for the prompt logprobs of ``prompts`` (token-id lists)."""
    return {
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
