"""What the server generators (vllm, sglang) share on trainer rank 0: a pool of replicas
found through their launchers' endpoint files, spoken to over HTTP.

:class:`ReplicaPool` dispatches each request to the ready replica with the fewest requests
in flight, at most ``max_concurrency`` at once, and retries it on another replica when
one fails. A replica a request failed on is out of service until its engine answers its
launcher again or a restarted server replaces it (:mod:`forgerl_plugins.serving.service`);
while no replica serves, a request waits for one, as long as a restart may take, instead
of spending its attempts; failures on servers that were since replaced do not count
against it. It is built of parts, each given what it needs: the engine's adapter
(:class:`.engine.Engine`: the HTTP client, how a request is sent and answered, how a
replica is met, paused, loaded and resumed), a watcher of the replicas' health and
restarts (:mod:`.watch`) and an updater of their weights (:mod:`.updates`). A generator
(vllm, sglang) is this pool built with its engine's adapter.

All HTTP runs on one event loop in a thread of this object
(:class:`forgerl.loop_thread.LoopThread`): ``generate`` may be awaited
from any event loop (the rollout thread's, ``asyncio.run`` in evaluation) and shares one
connection pool and one view of the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError, GeneratorUnreachable, NotSupported
from forgerl.interfaces import Generator, RunContext
from forgerl.loop_thread import LoopThread
from forgerl.types import Completion, GenerationRequest, GeneratorHealth

from ...serving.launcher import endpoint_file, log_file
from ...serving.service import restart_allowance
from .replica import Replica
from .updates import WeightUpdater
from .watch import ReplicaWatcher

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger(__name__)


class ReplicaFailed(Exception):
    """The replica answered, but not with a usable result (5xx, 401, aborted)."""


class _Retry(Exception):
    """A request should be sent again (to another replica, or after an update)."""


class ReplicaPool(Generator):
    """``ReplicaPool(engine, options, *, context)``: connects to the replicas of
    ``context.run_dir`` through ``engine`` and dispatches the requests (see the module
    docstring). The options need ``replicas``, ``max_concurrency``, ``startup_timeout``,
    ``liveness_timeout``, ``health_interval`` and ``update_policy``. ``serving_dir``: where the replicas' endpoint
    files are when the servers are not the run's own (a shared fleet's directory)."""

    def __init__(self, engine: Engine, options: Any, *, context: RunContext, serving_dir: Path | None = None) -> None:
        self.engine = engine
        self.options = options
        run_dir = Path(serving_dir if serving_dir is not None else context.run_dir)
        # httpx logs every request at INFO: thousands of lines per step in the trainer's log.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self._closed = False
        role = engine.role
        self._replicas = [
            Replica(i, log_file(run_dir, role, i), endpoint_file(run_dir, role, i), role)
            for i in range(options.replicas)
        ]
        # Made here, used on the loop thread: asyncio's primitives bind to the loop that
        # first waits on them (Python >= 3.10).
        self._sem = asyncio.Semaphore(options.max_concurrency)
        self._changed = asyncio.Condition()  # a replica may serve now, or the version changed
        # Events go to the run's own directory, wherever its servers are.
        self.watcher = ReplicaWatcher(engine, run_dir=Path(context.run_dir), startup_timeout=options.startup_timeout)
        self.updater = WeightUpdater(
            engine,
            self._replicas,
            policy=options.update_policy,
            retry_after=10 * options.health_interval,
            notify=self._notify,
        )
        #: Seconds a request waits for a replica that serves (see :meth:`_pick`): a
        #: replica's replacement (its launcher finds it hung, a new server starts) and
        #: re-sync (one weight load, and a retry of a failed one).
        self.out_of_service_limit = restart_allowance(
            startup_timeout=options.startup_timeout,
            liveness_timeout=options.liveness_timeout,
            resync=context.transport_timeout + self.updater.retry_after,
        )
        self._io = LoopThread(f"forge-{role}-http")
        self._monitor: asyncio.Task | None = None
        try:
            self._io.call(self._start())
        except BaseException:
            self.close()
            raise

    async def _start(self) -> None:
        self.engine.connect(self.options.max_concurrency + 4 * self.options.replicas)
        deadline = time.monotonic() + self.options.startup_timeout
        await asyncio.gather(*(self.watcher.first_contact(r, deadline) for r in self._replicas))
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        urls = ", ".join(r.url for r in self._replicas)
        log.info("%s generator: %d replica(s) ready: %s", self.engine.role, len(self._replicas), urls)

    async def _watch(self) -> None:
        """Health checks, restarted replicas, and bringing stale replicas up to date."""
        while True:
            try:
                await asyncio.gather(*(self.watcher.check(r) for r in self._replicas))
                await self._notify()
                await self.updater.catch_up()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: replica watcher failed; continuing", self.engine.role)
            await asyncio.sleep(self.options.health_interval)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @property
    def policy_version(self) -> int:
        return self.updater.version

    def update_weights(self, version: int) -> None:
        """Load ``version`` into every replica that is up (:meth:`.updates.WeightUpdater.update`)."""
        if self._closed:
            raise GeneratorError(f"the {self.engine.role} generator is closed")
        self._io.call(self.updater.update(int(version)))

    # ---------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        if self._closed:
            raise GeneratorError(f"the {self.engine.role} generator is closed")
        if not self.accepts_images:
            # Said, never dropped: a server sent the ids alone would sample without the image.
            for request in requests:
                if request.images is not None:
                    raise NotSupported(
                        f"the {self.engine.role} generator does not take images yet (request "
                        f"{request.request_id!r}); use generator hf (docs/vision.md)"
                    )
        return await self._io.map(self._one, requests)

    async def _one(self, request: GenerationRequest) -> list[Completion]:
        import httpx

        failures: list[tuple[int, str | None, str]] = []  # (replica, its instance then, why)
        async with self._sem:
            tried: set[int] = set()
            while True:
                r = await self._pick(tried)
                # Failures on a server that has since been replaced (killed as hung, crashed,
                # restarted) were the server's: the scheduler's max_restarts bounds those.
                # The rest count: a request that fails on servers that stay is given up.
                charged = [f for f in failures if self._replicas[f[0]].instance == f[1]]
                if len(charged) >= 2 * len(self._replicas) + 1:
                    raise GeneratorError(
                        f"request {request.request_id!r} failed on every {self.engine.label} replica "
                        f"({len(charged)} attempts): {'; '.join(f'replica {i}: {why}' for i, _, why in charged[-3:])}"
                    )
                version, instance, aborts = r.version, r.instance, r.aborts
                assert version is not None, f"replica {r.index} was picked with unknown weights"
                r.outstanding += 1
                r.dispatched += 1
                r.idle.clear()
                try:
                    completions = await self.engine.send(r, request, version)
                    if r.aborts != aborts and r.instance == instance:
                        raise _Retry()  # an abort-policy update overlapped it: see Replica.aborts
                    return completions
                except _Retry:
                    continue  # aborted for a weight update: resubmitted, not a failure
                except (httpx.HTTPError, ReplicaFailed) as exc:
                    if r.aborts != aborts and r.instance == instance:
                        continue  # the abort of an update broke the request: resubmit
                    why = f"{type(exc).__name__}: {exc}".strip()
                    failures.append((r.index, instance, why))
                    if r.instance == instance:
                        # Out of service until its engine answers its launcher again or
                        # another server replaces it: the request waits for a replica
                        # that serves (_pick) instead of spending its attempts here.
                        r.take_out(why)
                    tried.add(r.index)
                    if len(tried) >= len(self._replicas):
                        tried.clear()  # every replica failed once: let restarted ones be tried again
                    log.warning(
                        "%s: request %s failed on replica %d (%s); retrying",
                        self.engine.role,
                        request.request_id,
                        r.index,
                        why,
                    )
                finally:
                    r.outstanding -= 1
                    if r.outstanding == 0:
                        r.idle.set()

    async def _pick(self, tried: set[int]) -> Replica:
        """The ready replica with the fewest requests in flight; waits while none is ready
        (every one killed, restarting, re-syncing or out of service after a failure), up to
        :attr:`out_of_service_limit`: long enough for a restart."""
        deadline = time.monotonic() + self.out_of_service_limit
        async with self._changed:
            while True:
                if self._closed:
                    raise GeneratorError(f"the {self.engine.role} generator is closed")
                ready = [r for r in self._replicas if self.updater.serves(r)]
                fresh = [r for r in ready if r.index not in tried] or ready
                if fresh:
                    return min(fresh, key=lambda r: (r.outstanding, r.dispatched, r.index))
                left = deadline - time.monotonic()
                if left <= 0:
                    states = "; ".join(r.describe() for r in self._replicas)
                    raise GeneratorUnreachable(
                        f"no {self.engine.label} replica has served for {self.out_of_service_limit:g} s "
                        f"(as long as a restart may take): {states}"
                    )
                try:
                    await asyncio.wait_for(
                        self._changed.wait(), timeout=min(left, self.options.health_interval)
                    )
                except asyncio.TimeoutError:
                    pass

    # ------------------------------------------------------------------ health

    def health(self) -> GeneratorHealth:
        serving = [r for r in self._replicas if self.updater.serves(r)]
        return GeneratorHealth(
            healthy=bool(serving) and not self._closed,
            policy_version=self.updater.version,
            replicas=len(self._replicas),
            healthy_replicas=len(serving),
            detail="; ".join(r.describe() for r in self._replicas),
        )

    def replica_info(self) -> list[dict[str, Any]]:
        """Per replica: url, pid, up, version, requests dispatched (for tests and tools)."""
        return [
            {
                "index": r.index,
                "url": r.url,
                "pid": r.pid,
                "instance": r.instance,
                "up": r.up,
                "serving": self.updater.serves(r),
                "version": r.version,
                "dispatched": r.dispatched,
                "outstanding": r.outstanding,
                "log": str(r.log),
            }
            for r in self._replicas
        ]

    def close(self) -> None:
        """Stop talking to the replicas (the scheduler stops the servers themselves)."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            if self._monitor is not None:
                self._monitor.cancel()
                with contextlib.suppress(BaseException):  # its CancelledError, awaited here
                    await self._monitor
            client = getattr(self.engine, "client", None)  # none where connect never ran
            if client is not None:
                release = getattr(self.engine, "release", None)  # what the run left on shared servers
                if release is not None:
                    async with self.updater.lock:  # not in the middle of an update
                        await release(self._replicas)
                await client.aclose()

        self._io.close(shutdown())
        self.engine.close()
