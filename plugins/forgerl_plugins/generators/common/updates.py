"""Weight updates of a server generator's replicas: which replicas load a version, what
a failure means, and bringing a replica that missed one up to date.

How one replica pauses, loads and resumes is the engine's ``_update_replica(r, version,
policy)`` (vllm: :mod:`..vllm.weights`; sglang: :mod:`..sglang.weights`). The update
policy decides what happens to requests in flight: ``wait`` drains our requests on the
replica first; ``abort`` aborts them (they are resubmitted once the new weights are in:
see :attr:`.replica.Replica.aborts`). A replica never serves while its weights change,
so every completion reports the version that produced all its tokens. A replica that
missed a version (down, restarted, failed half-way) is re-synced before it serves again.
While a replica is paused its launcher is told so (:mod:`.update_notice`): a paused engine
answers no liveness probe, and must not be killed as hung for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError, TransportError

from .replica import Replica
from .update_notice import UpdateNotice

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext, Transport

log = logging.getLogger(__name__)


class WeightUpdates:
    """Weight updates, mixed into :class:`~.pool.ReplicaPool` (whose state below they
    read and change, on its event loop)."""

    options: Any  # the engine's: update_policy, health_interval
    ctx: RunContext
    transport: Transport
    engine: str
    label: str
    last_update: dict[str, Any]
    _closed: bool
    _version: int
    _replicas: list[Replica]
    _update_replica: Callable[..., Coroutine[Any, Any, None]]
    _update_lock: asyncio.Lock
    _call: Callable[[Coroutine[Any, Any, Any]], Any]
    _notify: Callable[[], Coroutine[Any, Any, None]]
    _endpoint_file: Callable[[int], Path]

    def _pause_notice(self, r: Replica) -> UpdateNotice:
        """The notice to :meth:`~.update_notice.UpdateNotice.start` before ``r`` is paused
        and stop once it resumed (the engine's ``_update_replica``)."""
        return UpdateNotice(self._endpoint_file(r.index), r.instance)

    def update_weights(self, version: int) -> None:
        """Load ``version`` into every replica that is up (see the module docstring).

        From then on only ``version`` is served. A replica that missed it (down, hung, its
        connection lost mid-load) is brought to it by the watcher before it serves again,
        and generation waits for one that has it (up to ``startup_timeout``): a hung or
        killed server is replaced by its launcher and the scheduler, not fatal. Raises
        TransportError when replicas answered but could not load it (the transport or
        the weights failed); they then keep serving the last version, or reload it where
        a load failed half-way.
        """
        if self._closed:
            raise GeneratorError(f"the {self.engine} generator is closed")
        self._call(self._update(int(version)))

    async def _update(self, version: int) -> None:
        import httpx

        async with self._update_lock:
            targets = [r for r in self._replicas if r.up]
            for r in targets:  # before any await: nothing new reaches any of them
                r.updating = True
            start = time.perf_counter()
            results = await asyncio.gather(
                *(self._update_replica(r, version) for r in targets), return_exceptions=True
            )
            failures = [(r, res) for r, res in zip(targets, results) if isinstance(res, BaseException)]
            errors = [f"replica {r.index}: {type(e).__name__}: {e}" for r, e in failures]
            done = [r for r in targets if r.version == version]
            # Only unreachable replicas (no answer, or none up at all): they come back, or
            # are replaced, and are brought to this version then.
            unreachable = all(isinstance(e, httpx.HTTPError) for _, e in failures)
            if done or unreachable:
                self._version = version
            self.last_update = {
                "version": version,
                "seconds": time.perf_counter() - start,
                "replicas": [r.index for r in done],
                "errors": errors,
                "workers": {r.index: r.last_load for r in targets},
            }
            await self._notify()
            if not done and not unreachable:
                raise TransportError(f"no {self.label} replica loaded weights version {version}: {'; '.join(errors)}")
            if not done:
                states = "; ".join(r.describe() for r in self._replicas)
                log.warning(
                    "%s: no replica could load weights version %d now; each is brought to it when it "
                    "answers again (%s)", self.engine, version, states,
                )  # fmt: skip
            for e in errors:
                log.warning(
                    "%s: weights version %d not loaded on %s (reloaded before it serves again)", self.engine, version, e
                )

    async def _resync(self, r: Replica) -> None:
        """Bring ``r`` (restarted, left behind by a failed load, or back from a hang) to the
        current version before it takes traffic."""
        import httpx

        async with self._update_lock:
            version = self._version
            if not r.up or r.updating or r.version == version:
                return
            r.updating = True
            try:
                # Requests may still be in flight on it (it was slow, not dead): abort
                # them, never let them run on across the load.
                await self._update_replica(r, version, policy="abort")
                log.info("%s: replica %d brought to weights version %d", self.engine, r.index, version)
            except (TransportError, httpx.HTTPError) as exc:
                # Retried later, or the next update loads it anyway.
                r.next_resync = time.monotonic() + 10 * self.options.health_interval
                log.warning(
                    "%s: could not bring replica %d to version %d yet (%s); it serves once it has it",
                    self.engine, r.index, version, exc,
                )  # fmt: skip
        await self._notify()
