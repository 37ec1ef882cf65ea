"""Weight updates of the vllm generator's replicas.

Every replica that is up loads a new version through ``POST /collective_rpc`` into the
worker extension (:mod:`.worker_extension`), which pulls it from the run's transport
inside vLLM's workers. Around the load the replica is paused by the update policy:
``wait`` drains our requests on it first; ``abort`` aborts them (they are resubmitted
once the new weights are in: see :attr:`.replica.Replica.aborts`). A replica never serves
while its weights change, so every completion reports the version that produced all its
tokens. A replica that missed a version (down, restarted, failed half-way) is re-synced
before it serves again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError, TransportError

from .client import ReplicaClient, error_message
from .replica import Replica

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext, Transport

    from .options import VLLMGeneratorOptions

log = logging.getLogger(__name__)


class WeightUpdates:
    """Weight updates, mixed into :class:`~.generator.VLLMGenerator` (whose state below
    they read and change, on its event loop)."""

    options: VLLMGeneratorOptions
    ctx: RunContext
    transport: Transport
    last_update: dict[str, Any]
    _closed: bool
    _version: int
    _replicas: list[Replica]
    _client: ReplicaClient
    _update_lock: asyncio.Lock
    _call: Callable[[Coroutine[Any, Any, Any]], Any]
    _notify: Callable[[], Coroutine[Any, Any, None]]

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
            raise GeneratorError("the vllm generator is closed")
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
                raise TransportError(f"no vLLM replica loaded weights version {version}: {'; '.join(errors)}")
            if not done:
                states = "; ".join(r.describe() for r in self._replicas)
                log.warning(
                    "vllm: no replica could load weights version %d now; each is brought to it when it "
                    "answers again (%s)", version, states,
                )  # fmt: skip
            for e in errors:
                log.warning(
                    "vllm: weights version %d not loaded on %s (reloaded before it serves again)", version, e
                )

    async def _update_replica(self, r: Replica, version: int, policy: str | None = None) -> None:
        """Pause ``r`` by ``policy`` (default: the configured one), load ``version``, reset
        its prefix cache and resume it. The caller has set ``r.updating``."""
        import httpx

        policy = policy or self.options.update_policy
        paused = False
        try:
            if policy == "abort":
                # Before the pause: every request in flight now may be aborted, or queued
                # and run on the new weights; the generator resubmits all of them.
                r.aborts += 1
                await self._client.admin(r, "/pause", params={"mode": "abort"})
            else:
                await r.idle.wait()  # our requests on it finish with the weights they started with
                await self._client.admin(r, "/pause", params={"mode": "wait"})
            paused = True
            await self._load(r, version)
        except httpx.HTTPError as exc:
            # It stopped answering mid-update: what it holds is unknown.
            r.version = None
            r.take_out(f"weight update: {type(exc).__name__}: {exc}")
            raise
        finally:
            try:
                if paused and r.up:
                    await self._client.admin(r, "/reset_prefix_cache")
                    await self._client.admin(r, "/resume")
            except httpx.HTTPError as exc:
                r.take_out(f"resume after update: {type(exc).__name__}")
            r.updating = False

    async def _load(self, r: Replica, version: int) -> None:
        """Load ``version`` on every worker of ``r`` (the transport's, or the model folder's
        for version 0). Sets ``r.version``; raises TransportError on failure."""
        timeout = float(self.ctx.config.transport.timeout)
        request: dict[str, Any] = {
            "version": version,
            "timeout": timeout,
            "worker_prefix": f"vllm-{r.index}-{(r.instance or '')[:8]}",
        }
        if version == 0:
            request["source"] = "base"
        else:
            # The workers build the same transport from its name and options (as the run's
            # config gives them) and connect through the spec.
            request["source"] = "transport"
            request["transport"] = {
                "name": self.ctx.config.transport.name,
                "options": self.ctx.config.transport.options,
                "spec": self.transport.receiver_spec(),
            }
        resp = await self._client.load_weights(r, json.dumps(request), timeout)
        if resp.status_code != 200:
            r.version = None
            raise TransportError(
                f"replica {r.index}: collective_rpc HTTP {resp.status_code}: {error_message(resp)}"
            )
        results = resp.json().get("results") or []
        r.last_load = results
        failed = [x for x in results if not (isinstance(x, dict) and x.get("ok"))]
        if failed or not results:
            touched = any(isinstance(x, dict) and x.get("weights_touched") for x in failed) or not results
            if touched:
                r.version = None
            what = (
                "; ".join(str(x.get("error") if isinstance(x, dict) else x) for x in failed)
                or "no worker answered"
            )
            raise TransportError(f"replica {r.index} did not load weights version {version}: {what}")
        r.version = version
        log.debug("vllm: replica %d loaded version %d: %s", r.index, version, results)

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
                log.info("vllm: replica %d brought to weights version %d", r.index, version)
            except (TransportError, httpx.HTTPError) as exc:
                # Retried later, or the next update loads it anyway.
                r.next_resync = time.monotonic() + 10 * self.options.health_interval
                log.warning(
                    "vllm: could not bring replica %d to version %d yet (%s); it serves once it has it",
                    r.index, version, exc,
                )  # fmt: skip
        await self._notify()
