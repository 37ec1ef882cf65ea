"""The public path of what a backend's server roles and a scheduler use of a run directory (docs/plugins.md).

Kept for plugins and embedding code: the names live in :mod:`forgerl.rundirs.runs`, which
forgerl itself imports.
"""

from forgerl.rundirs.runs import append_line, server_role_command

__all__ = ["append_line", "server_role_command"]
