"""Slurm's ``--mem`` and ``--time`` syntax: checked when the scheduler's options are
validated, and read when a job's memory is rendered (here and by ``kubernetes``, which
takes the same Resources.memory strings)."""

from __future__ import annotations

import re

# Slurm's --mem: an integer with an optional K/M/G/T suffix (default megabytes). The
# Kubernetes-style binary suffixes (Ki, Mi, Gi, Ti) mean the same thing and are accepted,
# so that one Resources.memory string serves both schedulers.
MEMORY_RE = re.compile(r"^(?P<n>[0-9]+)(?P<unit>[KMGT]i?)?$", re.IGNORECASE)
# Slurm's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED / INFINITE.
TIME_RE = re.compile(
    r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(?::\d{1,2}){0,2}|UNLIMITED|INFINITE)$", re.IGNORECASE
)


def slurm_memory(value: str) -> str:
    """``value`` in Slurm's ``--mem`` syntax ("16G", "512M", "16000"); raises ValueError."""
    m = MEMORY_RE.match(value.strip())
    if not m:
        raise ValueError(
            f"invalid memory {value!r}: use an integer with an optional unit, e.g. '16G', '512M', '16Gi'"
        )
    unit = (m["unit"] or "").upper().rstrip("I")
    return f"{m['n']}{unit}"


def memory_mb(value: str) -> int:
    """Megabytes (Slurm's unit) in a memory string accepted by :func:`slurm_memory`."""
    text = slurm_memory(value)
    scale = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    unit = text[-1] if text[-1].isalpha() else "M"
    return max(1, int(int(text.rstrip("KMGT")) * scale[unit]))
