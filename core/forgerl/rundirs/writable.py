"""Whether a directory forge (or a backend) will write into can be used, found without
leaving anything behind: pre-flight checks call this so that a file in the way, a missing
parent, a read-only filesystem or one that refuses new directories is one line before a
run starts, not an ``OSError`` in a process a minute later.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def directory_problem(path: Path, *, create_parents: bool = True) -> str | None:
    """None when ``path`` is a writable directory or can be created as one, else why not
    (a phrase to follow the path in a message, e.g. "is a file").

    With ``create_parents=False`` only ``path`` itself may be missing: its parent must
    exist (a mistyped parent is more likely than a wish for a new tree of folders).
    """
    try:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == path:
            if not path.is_dir():
                return "is a file, not a directory"
        elif not existing.is_dir():
            return f"cannot be created: {str(existing)!r} is a file"
        elif not create_parents and existing != path.parent:
            return f"cannot be created: its parent {str(path.parent)!r} does not exist"
        # access(2) answers EROFS for a read-only filesystem even to root, whom modes do not stop.
        if not os.access(existing, os.W_OK | os.X_OK):
            where = "it" if existing == path else repr(str(existing))
            return f"is not writable ({where} is read-only or not ours)"
        if existing != path:
            return _mkdir_refused(existing, path)
    except OSError as exc:
        return f"cannot be used ({exc.strerror or errno.errorcode.get(exc.errno or 0, exc)})"
    return None


def _mkdir_refused(existing: Path, path: Path) -> str | None:
    """Make the first missing directory of ``path`` below ``existing`` and remove it again:
    None when the file system allows it, else why not. Some file systems that access(2)
    calls writable refuse every new directory (``/proc``, sysfs: even to root), and only
    trying tells."""
    first = path
    while first.parent != existing:
        first = first.parent
    try:
        os.mkdir(first, 0o700)
    except FileExistsError:
        return None  # made meanwhile, by someone else
    except OSError as exc:
        why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        return f"cannot be created: the file system of {str(existing)!r} refuses new directories ({why})"
    try:
        os.rmdir(first)
    except OSError:
        pass  # filled meanwhile by someone else: theirs now
    return None
