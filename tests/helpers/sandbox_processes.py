"""Processes a sandbox of the ``code`` reward (or the ``python`` environment) left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


@contextlib.contextmanager
def sandbox_workdir(prefix: str) -> Iterator[Path]:
    """A work directory for sandboxes, removed afterwards. Not under pytest's own temp
    dir: as root, programs run as another uid, which must be able to traverse to it."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o711)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)

