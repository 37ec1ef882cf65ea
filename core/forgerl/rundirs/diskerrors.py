"""A write of a run that failed on the disk, told as one line: the file, the cause in
words, and what to do about it (free space, make something writable), then how to go on.

A full disk, a quota or a read-only file system is the user's to fix, not a bug: every
writer of run files turns the OSError into :class:`~forgerl.errors.RunWriteError` through
:func:`write_failed` (checkpoints use :func:`advice` for their own message).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from forgerl.errors import RunWriteError


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (itself, or along its causes), if any."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def reason(cause: OSError) -> str:
    """``no space left on device``: the cause in words, lower case as in a sentence."""
    return os.strerror(cause.errno).lower() if cause.errno else str(cause)


def advice(cause: OSError | None, where: str) -> str:
    """What frees the write up: ``free space``, ``make DIR/ writable``, ..."""
    code = cause.errno if cause is not None else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space"
    if code in (errno.EACCES, errno.EPERM):
        return f"make {where}/ writable"
    if code == errno.EROFS:
        return f"make the file system of {where}/ writable"
    return f"check the disk holding {where}/"


def write_failed(path: Path, exc: OSError, then: str) -> RunWriteError:
    """``cannot write PATH: no space left on device; free space, then THEN``."""
    where = Path(exc.filename).parent if exc.filename else Path(path).parent
    return RunWriteError(f"cannot write {path}: {reason(exc)}; {advice(exc, str(where))}, then {then}")
