"""How many cores vLLM's CPU build binds its threads to.

vLLM binds its worker's OpenMP threads to cores itself and, by default, leaves one core per
worker out of the binding for its own scheduler process: on a 2-core machine generation
runs on one core. In a synchronous run (``loop.max_staleness=0``) the trainer waits while
the generator generates, so that core would sit idle; binding every core to the worker
was measured faster (docs/performance.md, benchmarks/vllm_cores.py). When rollouts overlap
training, the run's processes share the cores and vLLM's own split is kept.

A user's own ``VLLM_CPU_*`` binding (in the generator's ``env`` option or the environment)
always wins.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The variables through which vLLM's CPU build decides its binding.
BINDING_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def binding_env(max_staleness: int, user_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to the server's environment (nothing when the user decided)."""
    if any(var in user_env or var in environ for var in BINDING_VARS):
        return {}
    if max_staleness > 0:
        return {}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
