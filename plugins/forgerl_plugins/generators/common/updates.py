"""Weight updates of a server generator's replicas: which replicas load a version, what
happens to the requests in flight, what a failure means, and bringing a replica that missed
one up to date.

One replica's update: the update policy (one method each, :attr:`WeightUpdater.policies`)
deals with our requests in flight on it (``wait``: they drain; ``abort``: they are aborted
and resubmitted once the new weights are in, see :attr:`.replica.Replica.aborts`; ``keep``:
nothing, they are frozen where they are), then the engine pauses it in the policy's mode,
loads the version and resumes it. Before all that, while the replica still generates, the
engine may stage the version (read it from the transport: :meth:`.engine.Engine.stage`),
so that the pause holds only the load. Under ``wait`` and ``abort`` no request runs while the
weights change, so a completion's tokens all come from one version. Under ``keep`` the
frozen requests go on with the new weights: before the resume each is told how many tokens
it had sampled (:mod:`.crossings`), and its completion carries per-token versions. While
a replica is paused its launcher is told so (:mod:`.update_notice`): a paused engine
answers no liveness probe, and must not be killed as hung for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from forgerl.errors import TransportError

from .crossings import Crossing
from .replica import Replica
from .update_notice import UpdateNotice

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger(__name__)
Policy = Callable[[Replica], Awaitable[None]]


class WeightUpdater:
    """``WeightUpdater(engine, replicas, policy=..., retry_after=..., notify=...)``: updates
    ``replicas`` (the pool's list) through ``engine`` on the pool's event loop; ``policy``:
    the configured update policy; ``retry_after``: seconds before a failed re-sync is tried
    again; ``notify``: wakes the pool's requests waiting for a replica that serves."""

    def __init__(self, engine: Engine, replicas: list[Replica], *, policy: str, retry_after: float,
                 notify: Callable[[], Awaitable[None]]) -> None:  # fmt: skip
        self.engine = engine
        self.replicas = replicas
        self.retry_after = retry_after
        self.notify = notify
        #: Update policy -> what happens to a replica's requests in flight before the engine
        #: pauses it in that policy's mode.
        self.policies: dict[str, Policy] = {"wait": self._wait, "abort": self._abort, "keep": self._keep}
        self.policy = policy
        self.version = 0  # the version served: generation waits for a replica that has it
        self.loading: int | None = None  # the version an update is loading now
        #: Results of the last update (for benchmarks and logs).
        self.last_update: dict[str, Any] = {}
        self.lock = asyncio.Lock()  # one update or re-sync at a time

    async def _wait(self, r: Replica) -> None:
        await r.idle.wait()  # our requests on it finish with the weights they started with

    async def _abort(self, r: Replica) -> None:
        # Before the pause: every request in flight now may be aborted, or queued and run
        # on the new weights; the pool resubmits all of them.
        r.aborts += 1

    async def _keep(self, r: Replica) -> None:
        pass  # frozen in place by the pause; update_replica records where they were

    async def update(self, version: int) -> None:
        """Load ``version`` into every replica that is up; from then on only ``version`` is
        served. A replica that missed it (down, hung, its connection lost mid-load) is
        brought to it (:meth:`catch_up`) before it serves again, and generation waits for
        one that has it: a hung or killed server is replaced by its launcher and the
        scheduler, not fatal. Raises TransportError when replicas answered but none could
        load it (the transport or the weights failed); they then keep serving the last
        version, or reload it where a load failed half-way."""
        import httpx

        async with self.lock:
            targets = [r for r in self.replicas if r.up]
            for r in targets:  # before any await: nothing new reaches any of them
                r.updating = True
            start = time.perf_counter()
            self.loading = version
            try:
                results = await asyncio.gather(
                    *(self.update_replica(r, version) for r in targets), return_exceptions=True
                )
            finally:
                self.loading = None
            failures = [(r, res) for r, res in zip(targets, results) if isinstance(res, BaseException)]
            errors = [f"replica {r.index}: {type(e).__name__}: {e}" for r, e in failures]
            done = [r for r in targets if r.version == version]
            # Only unreachable replicas (no answer, or none up at all): they come back, or
            # are replaced, and are brought to this version then.
            unreachable = all(isinstance(e, httpx.HTTPError) for _, e in failures)
            if done or unreachable:
                self.version = version
            self.last_update = {
                "version": version,
                "seconds": time.perf_counter() - start,
                "replicas": [r.index for r in done],
                "errors": errors,
                "workers": {r.index: r.last_load for r in targets},
            }
            await self.notify()
            role = self.engine.role
            if not done and not unreachable:
                raise TransportError(
                    f"no {self.engine.label} replica loaded weights version {version}: {'; '.join(errors)}"
                )
            if not done:
                states = "; ".join(r.describe() for r in self.replicas)
                log.warning(
                    "%s: no replica could load weights version %d now; each is brought to it when it "
                    "answers again (%s)", role, version, states,
                )  # fmt: skip
            for e in errors:
                log.warning(
                    "%s: weights version %d not loaded on %s (reloaded before it serves again)", role, version, e
                )

    async def update_replica(self, r: Replica, version: int, policy: str | None = None) -> None:
        """Deal with ``r``'s requests in flight by ``policy`` (default: the configured one),
        pause it, load ``version`` and resume it. The caller has set ``r.updating``."""
        import httpx

        policy = policy or self.policy
        paused = False
        lost = False  # this update found the server unreachable
        notice = UpdateNotice(r.endpoint, r.instance)  # its launcher must not take the pause for a hang
        try:
            # The read of the version before the pause (the engine's stage), so that the
            # pause holds only the load; what is in flight meanwhile goes on generating.
            await self.engine.stage(r, version)
            await self.policies[policy](r)
            await notice.start()
            await self.engine.pause(r, policy)
            paused = True
            if policy == "keep":
                await self._load_kept(r, version)
            else:
                await self.engine.load(r, version)
            r.version = version
            log.debug("%s: replica %d loaded version %d", r.engine, r.index, version)
        except httpx.HTTPError as exc:
            lost = True
            r.version = None  # it stopped answering mid-update: what it holds is unknown
            r.take_out(f"weight update: {type(exc).__name__}: {exc}")
            raise
        finally:
            try:
                # Not ``r.up``: something else may take the replica out while it is paused
                # (one of our requests timing out on the frozen engine, a slow health check),
                # and a server that answers again is put back in service by the watcher,
                # still paused, holding every request sent to it. Only a server this update
                # could not reach is left as it is (a dead one's resume would only fail).
                if paused and not lost:
                    await self.engine.resume(r, policy)
            except httpx.HTTPError as exc:
                r.take_out(f"resume after update: {type(exc).__name__}")
            await notice.stop()
            r.updating = False

    async def _load_kept(self, r: Replica, version: int) -> None:
        """Under ``keep``: note where each frozen request stands, load, and tell them (before
        the resume: no token is sampled in between). A load that failed half-way leaves
        weights nobody can name: what was frozen is aborted and resubmitted instead."""
        old = r.version
        flights = list(r.flights.values())  # nothing new reaches it while it updates
        counts = await self.engine.sampled_so_far(r, [f.key for f in flights])
        try:
            await self.engine.load(r, version)
        except BaseException:
            if r.version != old:  # touched (None): the frozen requests must not go on
                r.aborts += 1
                await self.engine.pause(r, "abort")
            raise
        for f in flights:
            f.crossings.append(Crossing(counts.get(f.key, {}), version))

    def serves(self, r: Replica) -> bool:
        """Whether ``r`` may take requests now (:meth:`.replica.Replica.serves`)."""
        return r.serves(self.version, self.loading)

    async def catch_up(self) -> None:
        """Re-sync every replica that answers but serves another version (none while an
        update runs, which loads it anyway)."""
        for r in self.replicas:
            if (
                r.up
                and not r.updating
                and r.version != self.version
                and not self.lock.locked()
                and time.monotonic() >= r.next_resync
            ):
                await self.resync(r)

    async def resync(self, r: Replica) -> None:
        """Bring ``r`` (restarted, left behind by a failed load, or back from a hang) to the
        current version before it takes traffic."""
        import httpx

        async with self.lock:
            version = self.version
            if not r.up or r.updating or r.version == version:
                return
            r.updating = True
            try:
                # Requests may still be in flight on it (it was slow, not dead): abort
                # them, never let them run on across the load.
                await self.update_replica(r, version, policy="abort")
                log.info("%s: replica %d brought to weights version %d", r.engine, r.index, version)
            except (TransportError, httpx.HTTPError) as exc:
                # Retried later, or the next update loads it anyway.
                r.next_resync = time.monotonic() + self.retry_after
                log.warning(
                    "%s: could not bring replica %d to version %d yet (%s); it serves once it has it",
                    r.engine, r.index, version, exc,
                )  # fmt: skip
        await self.notify()
