"""forgerl's on/off environment switches (``FORGE_DEBUG``, ``FORGE_STRICT_PLUGINS``,
``FORGE_TRACE_HOOKS``), read one way everywhere: the ``forge`` command and a run's worker
processes must never disagree on whether a switch is on. Imports nothing heavy.
"""

from __future__ import annotations

import os

#: What turns a switch off (compared without case and surrounding spaces); unset is off too.
OFF_VALUES = ("", "0", "false", "no")


def env_flag(name: str) -> bool:
    """Whether switch ``name`` is on: unset, ``""``, ``0``, ``false`` or ``no`` is off,
    any other value on."""
    return os.environ.get(name, "").strip().lower() not in OFF_VALUES


def debug_enabled() -> bool:
    """``FORGE_DEBUG``: errors a user can fix keep their traceback instead of one line."""
    return env_flag("FORGE_DEBUG")
