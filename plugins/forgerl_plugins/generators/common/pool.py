"""What the server generators (vllm, sglang) share on trainer rank 0: a pool of replicas
found through their launchers' endpoint files, spoken to over HTTP.

:class:`ReplicaPool` dispatches each request to the ready replica with the fewest requests
in flight, at most ``max_concurrency`` at once, and retries it on another replica when
one fails; it watches the replicas (:mod:`.watch`) and updates their weights
(:mod:`.updates`). An engine supplies how one request is sent and answered (``_send``),
what to ask a replica it meets (``_introduce``), how one replica loads weights
(``_update_replica``), its HTTP client (``_make_client``) and its file names.

All HTTP runs on one event loop in a thread of this object
(:class:`forgerl.loop_thread.LoopThread`): ``generate`` may be awaited
from any event loop (the rollout thread's, ``asyncio.run`` in evaluation) and shares one
connection pool and one view of the replicas.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from forgerl.errors import GeneratorError, GeneratorUnreachable
from forgerl.interfaces import Generator, RunContext, Transport
from forgerl.loop_thread import LoopThread
from forgerl.types import Completion, GenerationRequest, GeneratorHealth

from .replica import Replica
from .updates import WeightUpdates
from .watch import ReplicaWatch

if TYPE_CHECKING:  # pragma: no cover
    from .client import HealthClient

log = logging.getLogger(__name__)
T = TypeVar("T")


class ReplicaFailed(Exception):
    """The replica answered, but not with a usable result (5xx, 401, aborted)."""


class _Retry(Exception):
    """A request should be sent again (to another replica, or after an update)."""


class ReplicaPool(ReplicaWatch, WeightUpdates, Generator):
    """``Engine(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir`` and dispatches the requests (see the module docstring). The
    options need ``replicas``, ``max_concurrency``, ``request_timeout``,
    ``startup_timeout``, ``health_interval`` and ``update_policy``."""

    engine = ""  # "vllm": the role, and who speaks in log messages
    label = ""  # "vLLM": in errors
    _client: Any

    def __init__(self, options: Any, *, context: RunContext, transport: Transport) -> None:
        self.options = options
        self.ctx = context
        self.transport = transport
        self.run_dir = Path(context.run_dir)
        # httpx logs every request at INFO: thousands of lines per step in the trainer's log.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self._version = 0
        self._closed = False
        self._replicas = [Replica(i, self._log_file(i), self.engine) for i in range(options.replicas)]
        #: Results of the last weight load per replica (for benchmarks and logs).
        self.last_update: dict[str, Any] = {}
        self._io = LoopThread(f"forge-{self.engine}-http")
        self._monitor: asyncio.Task | None = None
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    @abc.abstractmethod
    def _endpoint_file(self, index: int) -> Path: ...

    @abc.abstractmethod
    def _log_file(self, index: int) -> Path: ...

    @abc.abstractmethod
    def _make_client(self, connections: int) -> HealthClient: ...

    async def _introduce(self, r: Replica) -> None:
        """What to ask a replica that answers for the first time (or again)."""

    @abc.abstractmethod
    async def _send(self, r: Replica, request: GenerationRequest, version: int) -> list[Completion]:
        """``request``'s completions from ``r``, labelled ``version``. Raises
        ReplicaFailed or httpx's errors where another replica should be asked."""

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the generator's loop from another thread and wait for it."""
        return self._io.call(coro, timeout)

    async def _start(self) -> None:
        self._client = self._make_client(self.options.max_concurrency + 4 * self.options.replicas)
        self._sem = asyncio.Semaphore(self.options.max_concurrency)
        self._changed = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        for r in self._replicas:
            r.idle = asyncio.Event()
            r.idle.set()
        deadline = time.monotonic() + self.options.startup_timeout
        await asyncio.gather(*(self._first_contact(r, deadline) for r in self._replicas))
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        log.info(
            "%s generator: %d replica(s) ready: %s",
            self.engine,
            len(self._replicas),
            ", ".join(r.url for r in self._replicas),
        )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @property
    def policy_version(self) -> int:
        return self._version

    # ---------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        if self._closed:
            raise GeneratorError(f"the {self.engine} generator is closed")
        return await self._io.map(self._one, requests)

    async def _one(self, request: GenerationRequest) -> list[Completion]:
        import httpx

        attempts = 0
        errors: list[str] = []
        async with self._sem:
            tried: set[int] = set()
            while True:
                r = await self._pick(tried)
                version, instance, aborts = r.version, r.instance, r.aborts
                assert version is not None, f"replica {r.index} was picked with unknown weights"
                r.outstanding += 1
                r.dispatched += 1
                r.idle.clear()
                try:
                    completions = await self._send(r, request, version)
                    if r.aborts != aborts and r.instance == instance:
                        raise _Retry()  # an abort-policy update overlapped it: see Replica.aborts
                    return completions
                except _Retry:
                    continue  # aborted for a weight update: resubmitted, not a failure
                except (httpx.HTTPError, ReplicaFailed) as exc:
                    if r.aborts != aborts and r.instance == instance:
                        continue  # the abort of an update broke the request: resubmit
                    attempts += 1
                    why = f"{type(exc).__name__}: {exc}".strip()
                    errors.append(f"replica {r.index}: {why}")
                    if r.instance == instance:
                        r.take_out(why)
                    tried.add(r.index)
                    if len(tried) >= len(self._replicas):
                        tried.clear()  # every replica failed once: let restarted ones be tried again
                    if attempts >= 2 * len(self._replicas) + 1:
                        raise GeneratorError(
                            f"request {request.request_id!r} failed on every {self.label} replica "
                            f"({attempts} attempts): {'; '.join(errors[-3:])}"
                        ) from exc
                    log.warning(
                        "%s: request %s failed on replica %d (%s); retrying",
                        self.engine,
                        request.request_id,
                        r.index,
                        why,
                    )
                finally:
                    r.outstanding -= 1
                    if r.outstanding == 0:
                        r.idle.set()

    async def _pick(self, tried: set[int]) -> Replica:
        """The ready replica with the fewest requests in flight; waits (up to the start-up
        timeout: long enough for a restart) while none is ready."""
        deadline = time.monotonic() + self.options.startup_timeout
        async with self._changed:
            while True:
                if self._closed:
                    raise GeneratorError(f"the {self.engine} generator is closed")
                ready = [r for r in self._replicas if r.serves(self._version)]
                fresh = [r for r in ready if r.index not in tried] or ready
                if fresh:
                    return min(fresh, key=lambda r: (r.outstanding, r.dispatched, r.index))
                left = deadline - time.monotonic()
                if left <= 0:
                    states = "; ".join(r.describe() for r in self._replicas)
                    raise GeneratorUnreachable(
                        f"no {self.label} replica has served for {self.options.startup_timeout:g} s: {states}"
                    )
                try:
                    await asyncio.wait_for(
                        self._changed.wait(), timeout=min(left, self.options.health_interval)
                    )
                except asyncio.TimeoutError:
                    pass

    # ------------------------------------------------------------------ health

    def health(self) -> GeneratorHealth:
        serving = [r for r in self._replicas if r.serves(self._version)]
        return GeneratorHealth(
            healthy=bool(serving) and not self._closed,
            policy_version=self._version,
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
                "serving": r.serves(self._version),
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
            client = getattr(self, "_client", None)
            if client is not None:
                await client.aclose()

        self._io.close(shutdown())
