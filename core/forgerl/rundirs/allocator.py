"""How the trainer's processes allocate memory: glibc malloc tuned for a training loop.

A training step allocates and frees the same large tensors every micro-batch: logits
blocks, activations, gradients (the embedding's alone is 113 MB for SmolLM2). glibc's
malloc serves every block above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and returns it with ``munmap`` when freed, so each step faults in and zeroes those pages
again. Measured on a 2-core Xeon (SmolLM2-135M, bf16 autocast, 16 x 116 batch): 449,000
page faults and 1.5 s of system time per step, against 10,000 and 0.5 s with mmap off
and trimming off; the step went from 5.1 to 4.4 s, and a whole `forge run` trained 11-20%
more tokens per second (docs/performance.md). The price: freed memory stays with the
process for reuse, so its resident size stays at the step's high-water mark (+1.1 GB
peak over a 12-step demo run, 5.3 -> 6.4 GB).

So the trainer role starts with ``MALLOC_MMAP_MAX_=0`` (large blocks come from the heap
and are reused) and a trim threshold no step reaches. A user who chose an allocator
(``LD_PRELOAD`` of jemalloc or tcmalloc, ``GLIBC_TUNABLES``, any ``MALLOC_*`` setting, in
forge's environment or the scheduler's ``env`` option) keeps theirs: nothing is added
then. Other C libraries ignore these variables.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The variables set for the trainer's processes when the user chose nothing.
TRAINER_MALLOC_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    # 1 TiB: more than any step frees at once, so the heap's top is never given back.
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


def user_chose_allocator(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` already says how memory is allocated."""
    if any(name.startswith("MALLOC_") for name in environ):  # MALLOC_MMAP_MAX_, MALLOC_ARENA_MAX, ...
        return True
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    return "malloc" in environ.get("LD_PRELOAD", "")


def trainer_allocator_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the trainer role's environment adds, given the launching environment."""
    return {} if user_chose_allocator(environ) else dict(TRAINER_MALLOC_ENV)
