"""A weight update in progress, told by the generator to the launcher of the replica it pauses.

The launcher's liveness probes go through the engine (:mod:`forgerl_plugins.serving.liveness`),
and an engine that is paused for a weight load answers none of them until it resumes: to
the launcher it looks exactly like a wedged one. Only the generator knows that it paused the server and is still
waiting on the load, so it says so in the run directory, beside the replica's endpoint file
(``<run_dir>/generators/<role>-<replica>.updating``; the run directory is how generator and
launchers find each other on every scheduler). The notice is a lease: the generator renews
it every few seconds while it waits (each of its calls has its own time limit), names the
server instance it is updating, and removes it when the server resumes. The launcher excuses
its engine's silence only while the lease is fresh on its own clock, so a generator that
dies mid-update, or a notice meant for a server that has since been replaced, excuses
nothing for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

#: Seconds one renewal of the notice excuses; renewed three times as often.
LEASE = 30.0
SUFFIX = ".updating"


def notice_file(endpoint: Path) -> Path:
    """The notice of the replica whose endpoint file is ``endpoint``."""
    return endpoint.with_suffix(SUFFIX)


class UpdateNotice:
    """The generator's side, for one pause of one replica: :meth:`start` before the pause
    (writes the notice, then renews it), :meth:`stop` once the server resumed."""

    def __init__(self, endpoint: Path, instance: str | None, lease: float = LEASE) -> None:
        self.path = notice_file(endpoint)
        self.instance = instance
        self.lease = lease
        self._beat = 0
        self._task: asyncio.Task | None = None

    def _write(self) -> None:
        self._beat += 1
        data = {"instance": self.instance, "beat": self._beat, "lease": self.lease, "pid": os.getpid()}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:
            # The notice is a courtesy: without it a long load may get the server replaced
            # (and re-synced), which costs time but loses nothing.
            tmp.unlink(missing_ok=True)

    async def start(self) -> None:
        await asyncio.to_thread(self._write)  # written before the pause it announces
        self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            await asyncio.to_thread(self._write)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


class NoticeReader:
    """The launcher's side: whether a fresh notice names its server ``instance``."""

    def __init__(self, endpoint: Path, instance: str) -> None:
        self.path = notice_file(endpoint)
        self.instance = instance
        self._seen: tuple[Any, Any] | None = None  # (pid, beat) last read
        self._fresh_until = 0.0  # on this machine's monotonic clock

    def updating(self) -> bool:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(data, dict) or data.get("instance") != self.instance:
            return False
        # Freshness is judged on this clock when a renewal is first seen, never by
        # comparing the generator's clock (another machine, perhaps) with ours.
        key = (data.get("pid"), data.get("beat"))
        if key != self._seen:
            self._seen = key
            try:
                lease = float(data.get("lease", LEASE))
            except (TypeError, ValueError):
                lease = LEASE
            self._fresh_until = time.monotonic() + min(max(lease, 0.0), 10 * LEASE)
        return time.monotonic() < self._fresh_until
