"""Finding a server generator's replicas and watching them: health checks, failover, restarts.

A replica that fails (killed, hung: no answer to ``/health``) takes no traffic until it
answers again; a restarted one (a new endpoint file) is brought to the current weights
before it takes traffic. The launcher beside each server kills a hung one
(:mod:`.liveness`) and the scheduler restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl import events
from forgerl.errors import GeneratorUnreachable

from .replica import HEALTH_FAILURES, Replica, last_line, process_start_time, read_endpoint

if TYPE_CHECKING:  # pragma: no cover
    from .client import HealthClient

log = logging.getLogger(__name__)


class ReplicaWatch:
    """First contact and the watcher, mixed into :class:`~.pool.ReplicaPool` (whose state
    below they read and change, on its event loop). ``_introduce`` is the engine's: what
    to ask a replica that answers for the first time (model info, the weights it holds)."""

    options: Any  # the engine's options: startup_timeout, health_interval
    run_dir: Path
    engine: str  # "vllm": in log messages
    label: str  # "vLLM": in errors
    _endpoint_file: Callable[[int], Path]
    _introduce: Callable[[Replica], Coroutine[Any, Any, None]]
    _closed: bool
    _version: int
    _replicas: list[Replica]
    _client: HealthClient
    _update_lock: asyncio.Lock
    _notify: Callable[[], Coroutine[Any, Any, None]]
    _resync: Callable[[Replica], Coroutine[Any, Any, None]]

    async def _first_contact(self, r: Replica, deadline: float) -> None:
        import httpx

        # Files an earlier job left in this run directory (a resumed run) describe servers
        # that are gone: a report of failure counts only if written since this job began;
        # an endpoint only once the server behind it answers with its key.
        not_before = process_start_time() - 60.0
        events.announce(f"waiting for {self.label} replica {r.index} to answer /health (up to "
                        f"{self.options.startup_timeout:g} s)", stage="generator", run_dir=self.run_dir, log=r.log)
        while True:
            data = read_endpoint(self._endpoint_file(r.index))
            if data is not None and data.get("error"):
                if float(data.get("time", 0)) >= not_before:
                    raise GeneratorUnreachable(
                        f"{self.label} replica {r.index} failed to start: {data['error']}; log: {r.log}"
                    )
            elif data is not None:
                r.attach(data)
                try:
                    if await self._client.healthy(r):
                        await self._introduce(r)
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
                    f"{self.label} replica {r.index} did not become healthy within "
                    f"{self.options.startup_timeout:g} s{said}; see its log {r.log}"
                )
            await asyncio.sleep(0.5)

    async def _watch(self) -> None:
        """Health checks, restarted replicas, and bringing stale replicas up to date."""
        while not self._closed:
            try:
                await asyncio.gather(*(self._check(r) for r in self._replicas))
                await self._notify()
                for r in self._replicas:
                    if (
                        r.up
                        and not r.updating
                        and r.version != self._version
                        and not self._update_lock.locked()
                        and time.monotonic() >= r.next_resync
                    ):
                        await self._resync(r)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: replica watcher failed; continuing", self.engine)
            await asyncio.sleep(self.options.health_interval)

    async def _check(self, r: Replica) -> None:
        import httpx

        data = read_endpoint(self._endpoint_file(r.index))
        if data is not None and not data.get("error") and data.get("instance") != r.instance:
            log.info("%s: replica %d (re)started at %s:%s", self.engine, r.index, data.get("host"), data.get("port"))
            r.attach(data)
        elif data is None and r.up and r.updating is False:
            # The launcher removes its file when its server exits.
            r.take_out("its endpoint file is gone (server exited)")
            return
        if r.instance is None or r.updating:
            return
        if await self._client.healthy(r):
            if not r.up:
                try:
                    await self._introduce(r)
                except httpx.HTTPError as exc:
                    r.last_error = f"{type(exc).__name__}: {exc}"
                    return
                log.info("%s: replica %d answers at %s (weights version %s)", self.engine, r.index, r.url, r.version)
                r.last_error = ""
            r.up = True
        elif r.failures >= HEALTH_FAILURES and r.up:
            r.take_out(r.last_error)
