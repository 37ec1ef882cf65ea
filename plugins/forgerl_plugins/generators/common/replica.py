"""What a server generator (vllm, sglang) knows about one replica, and how it finds the
replica's server.

Each replica's launcher (:mod:`forgerl_plugins.serving.launcher`) writes an endpoint file
when its server is up (host, port, API key, model, pid, and an ``instance`` id that changes
on every restart) and removes it when the server exits; a start-up failure is written
there as ``error``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...serving.service import Outage
from .crossings import Flight

log = logging.getLogger(__name__)

# Consecutive failed health checks (timeouts) before a replica is taken out; a refused
# connection takes it out at once.
HEALTH_FAILURES = 3


@dataclass
class Replica:
    """What the generator knows about one replica."""

    index: int
    log: Path  # its server's output
    endpoint: Path  # its launcher's endpoint file (:mod:`.launcher`)
    engine: str = "generator"  # who speaks in log messages ("vllm", "sglang")
    instance: str | None = None  # changes when the replica restarts
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    model: str = ""
    pid: int | None = None
    max_model_len: int | None = None
    up: bool = False  # answering health checks
    updating: bool = False  # its weights are being replaced: no new requests
    version: int | None = None  # weights it serves; None: unknown (not asked yet, or a load failed half-way)
    probed: bool = False  # its workers were asked which version they hold
    # Updates that aborted its requests. A request that overlapped one is resubmitted even
    # if it finished: a paused server may queue a request that reaches it and run it after
    # the resume, on the new weights, so its answer cannot say which weights made it.
    aborts: int = 0
    outstanding: int = 0
    dispatched: int = 0
    failures: int = 0
    last_error: str = ""
    last_load: list[Any] = field(default_factory=list)  # what its workers reported
    next_resync: float = 0.0  # monotonic time before which a failed re-sync is not retried
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is outstanding
    #: Our requests on it now, by the engine's id: the updates they cross (policy ``keep``).
    flights: dict[str, Flight] = field(default_factory=dict)
    #: Set while taken out of service: a health check alone does not bring it back
    #: (:class:`~forgerl_plugins.serving.service.Outage`).
    outage: Outage | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    def describe(self) -> str:
        state = "updating" if self.updating else ("up" if self.up else "down")
        version = "unknown weights" if self.version is None else f"version {self.version}"
        why = f" ({self.last_error})" if self.last_error and not self.up else ""
        if self.outage is not None and not self.up:
            why += "; waiting for its engine to answer its launcher, or a restarted server"
        return f"replica {self.index} {state}, {version}{why}; log: {self.log}"

    def serves(self, current: int, loading: int | None = None) -> bool:
        """Whether it may take requests while ``current`` is the generator's version and
        ``loading`` the one an update is loading (None: no update runs)."""
        # A replica done with an update serves the new version while the others load it:
        # its completions report the newer version, which is right. Any other version
        # (a server met holding an older or a newer one: an earlier generator's, a resumed
        # run's) is reloaded by the watcher before it takes a request.
        if not self.up or self.updating or self.version is None:
            return False
        return self.version == current or self.version == loading

    def attach(self, data: dict[str, Any]) -> None:
        """Point this replica at the instance an endpoint file describes."""
        if data.get("instance") == self.instance:
            return
        self.instance = data.get("instance")
        self.url = f"http://{url_host(str(data['host']))}:{int(data['port'])}"
        self.headers = {"Authorization": f"Bearer {data['api_key']}"} if data.get("api_key") else {}
        self.model = str(data.get("model") or "")
        self.pid = data.get("pid")
        self.up = False
        self.outage = None  # a new server: its health check decides
        self.failures = 0
        self.probed = False
        self.version = None

    def take_out(self, why: str) -> None:
        """No traffic until it answers health checks again and its engine answers its
        launcher (or another server replaces it): its API may answer while its engine is
        wedged (:mod:`forgerl_plugins.serving.service`)."""
        if self.up:
            log.warning("%s: taking replica %d out of service: %s", self.engine, self.index, why)
        self.up = False
        self.failures = HEALTH_FAILURES
        self.last_error = why
        self.outage = Outage(self.endpoint, self.instance)  # counted from the latest failure

    def back_in_service(self) -> bool:
        """Whether a replica that answers its health check may take requests again."""
        if self.outage is not None and not self.outage.over(self.instance):
            return False
        self.outage = None
        return True


def read_endpoint(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def process_start_time() -> float:
    """When this process started (wall clock), from /proc; now where that is unavailable."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def last_line(path: Path) -> str:
    """The last non-empty line of a (server's) log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
