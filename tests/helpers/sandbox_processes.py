"""Processes a sandbox of the ``code`` reward (or the ``python`` environment) left behind."""

from __future__ import annotations

import os

from forgerl_plugins.rewards.sandbox import SANDBOX_UID_BASE


def sandbox_processes(workdir) -> list[str]:
    """Processes a sandbox left: running as a sandbox uid (as root), or with their working
    directory under the sandboxes' work directory."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + 4096 or cwd.startswith(str(workdir)):
            left.append(f"{entry} (uid {uid}, cwd {cwd})")
    return left
