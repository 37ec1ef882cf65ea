"""Folders in /dev/shm that a dead sender left behind.

A sender removes its folder when it closes; a trainer killed by SIGKILL or the OOM
killer never closes, and /dev/shm is memory: every version it left there (538 MB for
SmolLM2-135M) stays taken until the machine reboots, and on a shared node the next
runs are the ones the OOM killer hits. So each folder records its owner (:data:`OWNER`:
pid, the process's start time, boot id and pid namespace), and a new sender first
removes the folders whose owner is gone (:func:`sweep`).

A folder is only removed when that is certain: it is ours (same user), its record is
readable, it was made on this boot and in this pid namespace (another container sharing
/dev/shm sees other pids), and no process with that pid and start time exists (a reused
pid has another start time). A folder without a record (made by an older forgerl, or
still being made) is left alone. Without /proc (not Linux) nothing is recorded or swept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OWNER = ".owner"
PREFIX = "forgerl-"
#: An owner record is a few dozen bytes; anything larger is not one.
MAX_RECORD = 4096


def claim(folder: Path) -> None:
    """Record this process as ``folder``'s owner (written whole: a sweep never reads half)."""
    me = identity()
    if me is None:
        return
    tmp = folder / f"{OWNER}.tmp-{os.getpid()}"
    # Private, as every file of the folder is (tests/conformance/test_transport_auth.py).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me))
    os.replace(tmp, folder / OWNER)


def sweep(root: Path) -> list[Path]:
    """Remove the ``forgerl-*`` folders in ``root`` whose owner process is gone; the removed."""
    me = identity()
    if me is None:
        return []
    removed = []
    try:
        candidates = sorted(root.glob(PREFIX + "*"))
    except OSError:
        return []
    for folder in candidates:
        owner = _owner(folder)
        if owner is None or owner.get("boot") != me["boot"] or owner.get("pidns") != me["pidns"]:
            continue
        pid, start = owner.get("pid"), owner.get("start")
        if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int):
            continue
        if start_time(pid) == start:
            continue  # its owner still runs
        size = _size(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            log.info("shm: removed %s (%.0f MiB), left by process %d, which is gone", folder, size / 2**20, pid)
            removed.append(folder)
    return removed


def identity() -> dict[str, Any] | None:
    """This process as an owner record; None without /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    start = start_time(os.getpid())
    if start is None:
        return None
    return {"pid": os.getpid(), "start": start, "boot": boot, "pidns": pidns}


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot; None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its last ")".
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def _owner(folder: Path) -> dict[str, Any] | None:
    """``folder``'s owner record, if it is our own real folder holding a sane one."""
    try:
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        record = folder / OWNER
        rst = record.lstat()
        if not stat.S_ISREG(rst.st_mode) or rst.st_size > MAX_RECORD:
            return None
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _size(folder: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total
