"""The server role of the ``sglang`` generator: one launcher process per replica.

``roles(options, *, context)`` tells the scheduler to run ``replicas`` copies of::

    python -m forgerl.server_role --run-dir RUN_DIR --role sglang

Each copy (its replica index comes from ``FORGE_REPLICA``) loads the run's config,
prepares the run's model exactly as the trainer does, and calls :func:`serve` (through
``SGLangGenerator.serve``), which runs ``python -m sglang.launch_server`` under the key
guard (:mod:`.guard`: every path needs the run's key) through the launcher all served
engines share (:mod:`forgerl_plugins.serving.launcher`: free port, ``/health``, one first
``/generate``, the endpoint file ``<run_dir>/generators/sglang-<replica>.json``, liveness,
exit status). It imports neither SGLang nor torch: it only spawns them.
"""

from __future__ import annotations

import secrets
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events
from forgerl_plugins.generators.common.update_notice import NoticeReader
from forgerl_plugins.generators.sglang import guard
from forgerl_plugins.serving import launcher

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.adapters import LoraOptions
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec

    from .options import Options

ROLE = "sglang"
#: The weight version a fresh server reports (``--weight-version``): the model folder's.
INITIAL_VERSION = "0"
#: SGLang returns logprobs before temperature scaling when this is set; the trainer's
#: contract is log_softmax(logits / T) (SGLang's default), so the servers never see it.
_UNSCALED_LOGPROBS_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def endpoint_file(run_dir: Path, replica: int) -> Path:
    return launcher.endpoint_file(run_dir, ROLE, replica)


def log_file(run_dir: Path, replica: int) -> Path:
    return launcher.log_file(run_dir, ROLE, replica)


def roles(options: Options, *, context: RunContext) -> list[RoleSpec]:
    """The server role the scheduler starts beside the trainer."""
    from forgerl.rundirs.runs import server_role_command
    from forgerl.types import Resources, RoleSpec

    return [
        RoleSpec(
            name=ROLE,
            command=server_role_command(context.run_dir, ROLE),
            replicas=options.replicas,
            resources=Resources(cpus=1, gpus=options.tensor_parallel_size),
            max_restarts=options.max_restarts,
        )
    ]


def server_command(
    options: Options, model_dir: Path, model_dtype: str, port: int, adapter: LoraOptions | None = None
) -> list[str]:
    """``sglang.launch_server`` for ``model_dir`` on ``options.host:port`` with our options
    (and LoRA on, for the trainer's ``adapter``), run by the launch command's Python under
    the key guard (:mod:`.guard`, which adds the key, from the environment, to the server's
    own arguments in its process only)."""
    dtype = model_dtype if options.dtype == "auto" else options.dtype
    python, *program = options.launch_command or [sys.executable, "-m", "sglang.launch_server"]
    args = [
        python, "-m", guard.MODULE, *program,
        "--model-path", str(model_dir),
        "--host", options.host,
        "--port", str(port),
        "--dtype", dtype,
        "--tp-size", str(options.tensor_parallel_size),
        "--weight-version", INITIAL_VERSION,
        # The launcher sends its own first request; SGLang's warm-up would only add time.
        "--skip-server-warmup",
    ]  # fmt: skip
    if options.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(options.mem_fraction_static)]
    if options.context_length is not None:
        args += ["--context-length", str(options.context_length)]
    if adapter is not None:
        from .adapter import server_flags

        args += server_flags(adapter)
    args += server_arg_flags(options.server_args)  # last: the user's own say wins
    return args


def server_arg_flags(server_args: dict[str, Any]) -> list[str]:
    """``{chunked_prefill_size: 4096, enable_metrics: true}`` → ``--chunked-prefill-size 4096
    --enable-metrics`` (SGLang's flags are its ServerArgs fields; booleans are bare flags)."""
    return launcher.cli_flags(server_args, negative=False)


def server_env(options: Options, api_key: str) -> dict[str, str]:
    env = launcher.server_env(options.env)
    env.pop(_UNSCALED_LOGPROBS_ENV, None)  # neither from our environment nor the env option
    # For the guard, which takes it out of the environment before SGLang starts: never on a
    # command line, which `ps` shows every user.
    env[guard.KEY_ENV] = api_key
    return env


def first_request(url: str, api_key: str, timeout: float = 120.0) -> str | None:
    """None when a one-token ``/generate`` with logprobs works and ``/health`` without the
    key is refused (the guard is in front of the app), else what went wrong."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return (
                f"GET /health answered HTTP {r.status} without the run's key: the server's endpoints are "
                f"not guarded (does its launch command serve the app with uvicorn, under {guard.MODULE}?)"
            )
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            return f"GET /health without the run's key: HTTP {exc.code} {exc.reason}, expected 401"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"GET /health without the key: {type(exc).__name__}: {exc}"
    body = {
        "input_ids": [0],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
    }
    try:
        launcher.post_json(url + "/generate", body, api_key, timeout)
        return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.reason}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def engine_probe(url: str, api_key: str) -> Callable[[float], bool]:
    """The launcher's liveness probe, through the engine: SGLang's ``/health_generate``
    answers 200 once its scheduler produced any output since the call began (a busy
    engine), or the one token the call itself asks for (an idle one)."""

    def probe(timeout: float) -> bool:
        request = urllib.request.Request(url + "/health_generate", headers={"Authorization": f"Bearer {api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


def serve(options: Options, *, context: RunContext, role: str, replica: int) -> int:
    """Run replica ``replica`` of the role (the launcher, until its server ends); the exit status."""
    run_dir, model_dir = context.run_dir, context.model_path
    assert model_dir is not None, "forgerl.server_role prepares a generator's model"
    # A file left by the previous instance of this replica points at a dead server.
    endpoint_file(run_dir, replica).unlink(missing_ok=True)
    api_key = secrets.token_urlsafe(24)
    starting = events.phase(
        "starting the SGLang server", detail="loading the model, then one first request",
        stage="server", key=f"sglang-start:{context.model_name}", run_dir=run_dir, log=log_file(run_dir, replica),
    )  # fmt: skip
    plan = launcher.ServerPlan(
        role=ROLE,
        engine="SGLang",
        host=options.host,
        startup_timeout=options.startup_timeout,
        health_interval=options.health_interval,
        liveness_timeout=options.liveness_timeout,
        command=lambda port: server_command(options, model_dir, context.dtype, port, context.adapter),
        env=server_env(options, api_key),
        api_key=api_key,
        first_request=first_request,
        endpoint={"model_path": str(model_dir)},
        engine_probe=engine_probe,
        probe_name="/health_generate (its engine)",
        paused=lambda endpoint, instance: NoticeReader(endpoint, instance).updating,
    )
    return launcher.serve(plan, run_dir, replica, starting)
