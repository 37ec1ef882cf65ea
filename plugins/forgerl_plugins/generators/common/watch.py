"""Finding a server generator's replicas and watching them: health checks, failover, restarts.

A replica that fails (killed, hung: no answer to ``/health``, a request that failed on
it) takes no traffic until it answers again and its engine answered its launcher since
(:mod:`forgerl_plugins.serving.service`); a restarted one (a new endpoint file) is met again (the engine's
``introduce``) and brought to the current weights (:mod:`.updates`) before it takes
traffic. The launcher beside each server kills a hung one (:mod:`.liveness`) and the
scheduler restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl import events
from forgerl.errors import GeneratorUnreachable

from .replica import HEALTH_FAILURES, Replica, last_line, process_start_time, read_endpoint

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger(__name__)


class ReplicaWatcher:
    """``ReplicaWatcher(engine, run_dir=..., startup_timeout=...)``: first contact with a
    replica, then one health check of it at a time (the pool runs them every
    ``health_interval``), on the pool's event loop."""

    def __init__(self, engine: Engine, *, run_dir: Path, startup_timeout: float) -> None:
        self.engine = engine
        self.run_dir = run_dir
        self.startup_timeout = startup_timeout

    async def first_contact(self, r: Replica, deadline: float) -> None:
        """Wait until ``r`` answers and was introduced; GeneratorUnreachable past ``deadline``
        (monotonic) or when its launcher reports that the server failed to start."""
        import httpx

        label = self.engine.label
        # Files an earlier job left in this run directory (a resumed run) describe servers
        # that are gone: a report of failure counts only if written since this job began;
        # an endpoint only once the server behind it answers with its key.
        not_before = process_start_time() - 60.0
        events.announce(f"waiting for {label} replica {r.index} to answer /health (up to "
                        f"{self.startup_timeout:g} s)", stage="generator", run_dir=self.run_dir, log=r.log)
        while True:
            data = read_endpoint(r.endpoint)
            if data is not None and data.get("error"):
                if float(data.get("time", 0)) >= not_before:
                    raise GeneratorUnreachable(
                        f"{label} replica {r.index} failed to start: {data['error']}; log: {r.log}"
                    )
            elif data is not None:
                r.attach(data)
                try:
                    if await self.engine.client.healthy(r):
                        await self.engine.introduce(r)
                        r.up = True
                        return
                except httpx.HTTPError as exc:  # e.g. 401: another server has that port now
                    r.last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                last = last_line(r.log)
                said = f" (last log line: {last})" if last else ""
                if r.last_error:  # it runs, but does not answer us as it should (e.g. 401)
                    said = f" (it answered: {r.last_error}){said}"
                raise GeneratorUnreachable(
                    f"{label} replica {r.index} did not become healthy within "
                    f"{self.startup_timeout:g} s{said}; see its log {r.log}"
                )
            await asyncio.sleep(0.5)

    async def check(self, r: Replica) -> None:
        """One look at ``r``: a restart (a new endpoint file), an exit (none), its health."""
        import httpx

        data = read_endpoint(r.endpoint)
        if data is not None and not data.get("error") and data.get("instance") != r.instance:
            log.info("%s: replica %d (re)started at %s:%s", r.engine, r.index, data.get("host"), data.get("port"))
            r.attach(data)
        elif data is None and r.up and r.updating is False:
            # The launcher removes its file when its server exits.
            r.take_out("its endpoint file is gone (server exited)")
            return
        if r.instance is None or r.updating:
            return
        if await self.engine.client.healthy(r):
            if not r.up:
                if not r.back_in_service():
                    return  # /health answers, its engine has not yet (or not since it failed us)
                try:
                    await self.engine.introduce(r)
                except httpx.HTTPError as exc:
                    r.last_error = f"{type(exc).__name__}: {exc}"
                    return
                log.info("%s: replica %d answers at %s (weights version %s)", r.engine, r.index, r.url, r.version)
                r.last_error = ""
            r.up = True
        elif r.failures >= HEALTH_FAILURES and r.up:
            r.take_out(r.last_error)
