"""The server role of a model a backend serves for itself (the served ``reward_model``, the
distillation teacher): its name, and the RoleSpec the scheduler runs.

The name is ``<prefix>-<digest>`` of what shapes the server (model, dtype, parallelism,
engine arguments, ...): two backends whose servers would be the same share one role.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .vllm_server import is_cpu_build

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec


def role_name(prefix: str, shaping: Mapping[str, Any]) -> str:
    """``prefix-<8 hex digits>`` of ``shaping``; equal values give equal names."""
    digest = hashlib.sha256(json.dumps(dict(shaping), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{prefix}-{digest}"


def served_role(name: str, context: RunContext, *, tensor_parallel_size: int, max_restarts: int) -> RoleSpec:
    """One replica of ``python -m forgerl.server_role ... --role NAME``: a core, and
    ``tensor_parallel_size`` GPUs unless vLLM is its CPU build; restarted up to
    ``max_restarts`` times when it dies."""
    from forgerl.rundirs.runs import server_role_command
    from forgerl.types import Resources, RoleSpec

    return RoleSpec(
        name=name,
        command=server_role_command(context.run_dir, name),
        resources=Resources(cpus=1, gpus=0 if is_cpu_build() else tensor_parallel_size),
        max_restarts=max_restarts,
    )
