"""The ``vllm`` generator: vLLM OpenAI servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`VLLMGenerator`. It finds the replicas through the endpoint
files their launchers write (:mod:`.server`), then:

* **generates** with one ``/v1/completions`` request per prompt (``n`` completions,
  prompt as token ids, ``logprobs: 0`` and ``return_token_ids``), sent to the ready
  replica with the fewest requests in flight, at most ``max_concurrency`` at once, and
  retried on another replica when one fails (here; the request body and the answer:
  :mod:`.completions`; every HTTP call, with the replica's key: :mod:`.client`);
* **updates weights** (:mod:`.weights`) on every replica through ``POST /collective_rpc``
  into the worker extension (:mod:`.worker_extension`), which pulls the version from the
  run's transport inside vLLM's workers. ``wait`` drains the replica's requests first;
  ``abort`` aborts them and resubmits them once the new weights are in. A replica never
  serves while its weights change, so every completion reports the version that produced
  all its tokens;
* **watches** the replicas (:mod:`.watch`, :mod:`.replica`): one that fails (killed,
  hung) takes no traffic until it answers again; a restarted one (a new endpoint file) is
  brought to the current version before it takes traffic.

All HTTP runs on one event loop in a thread of this object
(:class:`forgerl.loop_thread.LoopThread`): ``generate`` may be awaited from any event loop
(the rollout thread's, ``asyncio.run`` in evaluation) and shares one connection pool and
one view of the replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from forgerl.errors import GeneratorError, GeneratorUnreachable
from forgerl.interfaces import Generator, RunContext, Transport
from forgerl.loop_thread import LoopThread
from forgerl.types import Completion, GenerationRequest, GeneratorHealth

from .client import ReplicaClient
from .completions import ReplicaFailed, parse_completions, request_body
from .replica import Replica
from .server import log_file
from .watch import ReplicaWatch
from .weights import WeightUpdates

if TYPE_CHECKING:  # pragma: no cover
    from forgerl_plugins.generators.vllm.options import VLLMGeneratorOptions

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Retry(Exception):
    """A request should be sent again (to another replica, or after an update)."""


class VLLMGenerator(ReplicaWatch, WeightUpdates, Generator):
    """``VLLMGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir``; their workers receive new weights through ``transport``'s
    :meth:`~forgerl.interfaces.Transport.receiver_spec`.

    Replicas are found and watched in :mod:`.watch`, updated in :mod:`.weights`, and
    spoken to through :mod:`.client`; this class dispatches the requests."""

    def __init__(self, options: VLLMGeneratorOptions, *, context: RunContext, transport: Transport) -> None:
        self.options = options
        self.ctx = context
        self.transport = transport
        self.run_dir = Path(context.run_dir)
        # httpx logs every request at INFO: thousands of lines per step in the trainer's log.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self.send_seed = options.send_seed  # on the CPU build, see server.whole_prefill_args
        self._version = 0
        self._closed = False
        self._replicas = [Replica(i, log_file(self.run_dir, i)) for i in range(options.replicas)]
        #: Results of the last weight load per replica (for benchmarks and logs).
        self.last_update: dict[str, Any] = {}
        self._io = LoopThread("forge-vllm-http")
        self._monitor: asyncio.Task | None = None
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the generator's loop from another thread and wait for it."""
        return self._io.call(coro, timeout)

    async def _start(self) -> None:
        self._client = ReplicaClient(
            self.options.max_concurrency + 4 * self.options.replicas, self.options.request_timeout
        )
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
            "vllm generator: %d replica(s) ready: %s",
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
            raise GeneratorError("the vllm generator is closed")
        return await self._io.map(self._one, requests)

    async def _one(self, request: GenerationRequest) -> list[Completion]:
        import httpx

        attempts = 0
        errors: list[str] = []
        async with self._sem:
            tried: set[int] = set()
            while True:
                r = await self._pick(tried)
                body = request_body(request, r, send_seed=self.send_seed)
                body["request_id"] = f"{request.request_id}-{os.urandom(4).hex()}"
                version, instance, aborts = r.version, r.instance, r.aborts
                assert version is not None, f"replica {r.index} was picked with unknown weights"
                r.outstanding += 1
                r.dispatched += 1
                r.idle.clear()
                try:
                    resp = await self._client.complete(r, body)
                    if r.aborts != aborts and r.instance == instance:
                        raise _Retry()  # an abort-policy update overlapped it: see Replica.aborts
                    return parse_completions(request, resp, version)
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
                            f"request {request.request_id!r} failed on every vLLM replica "
                            f"({attempts} attempts): {'; '.join(errors[-3:])}"
                        ) from exc
                    log.warning(
                        "vllm: request %s failed on replica %d (%s); retrying",
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
                    raise GeneratorError("the vllm generator is closed")
                ready = [r for r in self._replicas if r.serves(self._version)]
                fresh = [r for r in ready if r.index not in tried] or ready
                if fresh:
                    return min(fresh, key=lambda r: (r.outstanding, r.dispatched, r.index))
                left = deadline - time.monotonic()
                if left <= 0:
                    states = "; ".join(r.describe() for r in self._replicas)
                    raise GeneratorUnreachable(
                        f"no vLLM replica has served for {self.options.startup_timeout:g} s: {states}"
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
            client = getattr(self, "_client", None)
            if client is not None:
                await client.aclose()

        self._io.close(shutdown(), timeout=10)
