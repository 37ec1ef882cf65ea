"""Reading a user-named file that may be a FIFO, without sleeping through a signal.

``forge run <(make-config)`` hands forge a FIFO, and a FIFO whose writer has not written
yet blocks ``read()``. A SIGTERM or SIGINT that lands after Python's last check for
signals but before the process enters that ``read()`` does not interrupt it: the handler
runs only when the read returns, which may be never (seen under load: about 1 start-up in
10 ignored its SIGTERM). So a FIFO is read without blocking, waking every
:data:`WAKE_S` to let pending signal handlers run.
"""

from __future__ import annotations

import os
import select
import stat
from pathlib import Path

#: Longest a signal that arrived while forge waits for a FIFO's writer goes unhandled.
WAKE_S = 0.2


def read_capped(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path`` (fewer at its end). OSError as ``open`` raises it."""
    with path.open("rb") as f:
        if not stat.S_ISFIFO(os.fstat(f.fileno()).st_mode):
            return f.read(limit)
        fd = f.fileno()
        os.set_blocking(fd, False)
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            select.select([fd], [], [], WAKE_S)  # returns to Python at least every WAKE_S
            try:
                chunk = os.read(fd, min(1 << 16, limit - size))
            except BlockingIOError:
                continue
            if not chunk:  # every writer closed
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
