"""The ``vllm`` generator: vLLM OpenAI servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`VLLMGenerator`. It finds the replicas through the endpoint
files their launchers write (:mod:`.server`), then:

* **generates** with one ``/v1/completions`` request per prompt (``n`` completions,
  prompt as token ids, ``logprobs: 0`` and ``return_token_ids``), sent to the ready
  replica with the fewest requests in flight, at most ``max_concurrency`` at once, and
  retried on another replica when one fails;
* **updates weights** on every replica through ``POST /collective_rpc`` into the worker
  extension (:mod:`.worker_extension`), which pulls the version from the run's transport
  inside vLLM's workers. ``wait`` drains the replica's requests first; ``abort`` aborts
  them and resubmits them once the new weights are in. A replica never serves while its
  weights change, so every completion reports the version that produced all its tokens;
* **watches** the replicas: one that fails (killed, hung) takes no traffic until it
  answers again; a restarted one (a new endpoint file) is brought to the current version
  before it takes traffic.

All HTTP runs on one event loop in a thread of this object: ``generate`` may be awaited
from any event loop (the rollout thread's, ``asyncio.run`` in evaluation) and shares one
connection pool and one view of the replicas.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from forgerl.errors import GeneratorError, GeneratorUnreachable, TransportError
from forgerl.interfaces import Generator, RunContext, Transport
from forgerl.types import Completion, FinishReason, GenerationRequest, GeneratorHealth

from .server import endpoint_file, log_file

if TYPE_CHECKING:  # pragma: no cover
    import httpx
    from forgerl_plugins.generators.vllm.options import VLLMGeneratorOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# Consecutive failed health checks (timeouts) before a replica is taken out; a refused
# connection takes it out at once.
_HEALTH_FAILURES = 3
_HEALTH_TIMEOUT = 10.0
# Seconds an admin call (pause, resume, cache reset) may take.
_ADMIN_TIMEOUT = 30.0
# Margin on top of the transport's timeout for one weight load over HTTP.
_LOAD_MARGIN = 60.0


@dataclass
class _Replica:
    """What the generator knows about one replica."""

    index: int
    log: Path
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
    # if it finished: vLLM queues a request that reaches it while paused and runs it after
    # the resume, on the new weights, so its answer cannot say which weights made it.
    aborts: int = 0
    outstanding: int = 0
    dispatched: int = 0
    failures: int = 0
    last_error: str = ""
    last_load: list[Any] = field(default_factory=list)  # what its workers reported
    next_resync: float = 0.0  # monotonic time before which a failed re-sync is not retried
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def describe(self) -> str:
        state = "updating" if self.updating else ("up" if self.up else "down")
        version = "unknown weights" if self.version is None else f"version {self.version}"
        why = f" ({self.last_error})" if self.last_error and not self.up else ""
        return f"replica {self.index} {state}, {version}{why}; log: {self.log}"


class _Retry(Exception):
    """A request should be sent again (to another replica, or after an update)."""


class VLLMGenerator(Generator):
    """``VLLMGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir``; their workers receive new weights through ``transport``'s
    :meth:`~forgerl.interfaces.Transport.receiver_spec`."""

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
        self._replicas = [_Replica(i, log_file(self.run_dir, i)) for i in range(options.replicas)]
        #: Results of the last weight load per replica (for benchmarks and logs).
        self.last_update: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="forge-vllm-http", daemon=True)
        self._thread.start()
        self._monitor: asyncio.Task | None = None
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the generator's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        import httpx

        limit = self.options.max_concurrency + 4 * self.options.replicas
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            timeout=httpx.Timeout(self.options.request_timeout, connect=10.0),
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

    async def _first_contact(self, r: _Replica, deadline: float) -> None:
        import httpx

        # Files an earlier job left in this run directory (a resumed run) describe servers
        # that are gone: a report of failure counts only if written since this job began;
        # an endpoint only once the server behind it answers with its key.
        not_before = _process_start_time() - 60.0
        while True:
            data = _read_endpoint(endpoint_file(self.run_dir, r.index))
            if data is not None and data.get("error"):
                if float(data.get("time", 0)) >= not_before:
                    raise GeneratorUnreachable(
                        f"vLLM replica {r.index} failed to start: {data['error']}; log: {r.log}"
                    )
            elif data is not None:
                self._attach(r, data)
                try:
                    if await self._healthy(r):
                        await self._fetch_model_info(r)
                        await self._probe_version(r)
                        r.up = True
                        return
                except httpx.HTTPError as exc:  # e.g. 401: another server has that port now
                    r.last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                last = _last_line(r.log)
                said = f" (last log line: {last})" if last else ""
                if r.last_error:  # it runs, but does not answer us as it should (e.g. 401)
                    said = f" (it answered: {r.last_error}){said}"
                raise GeneratorUnreachable(
                    f"vLLM replica {r.index} did not become healthy within "
                    f"{self.options.startup_timeout:g} s{said}; see its log {r.log}"
                )
            await asyncio.sleep(0.5)

    def _attach(self, r: _Replica, data: dict[str, Any]) -> None:
        """Point ``r`` at the instance an endpoint file describes."""
        if data.get("instance") == r.instance:
            return
        r.instance = data.get("instance")
        r.url = f"http://{_url_host(str(data['host']))}:{int(data['port'])}"
        r.headers = {"Authorization": f"Bearer {data['api_key']}"} if data.get("api_key") else {}
        r.model = str(data.get("model") or "")
        r.pid = data.get("pid")
        r.up = False
        r.failures = 0
        r.probed = False
        r.version = None

    async def _fetch_model_info(self, r: _Replica) -> None:
        resp = await self._client.get(r.url + "/v1/models", headers=r.headers, timeout=_HEALTH_TIMEOUT)
        resp.raise_for_status()
        models = resp.json().get("data") or []
        if models:
            r.model = r.model or str(models[0].get("id", ""))
            length = models[0].get("max_model_len")
            r.max_model_len = int(length) if length else None

    async def _probe_version(self, r: _Replica) -> None:
        """Ask the workers which weights they hold: 0 for a fresh server (the model folder);
        a server this generator did not start may hold anything."""
        resp = await self._client.post(
            r.url + "/collective_rpc",
            json={"method": "forge_policy_version"},
            headers=r.headers,
            timeout=60.0,
        )
        resp.raise_for_status()
        versions = {int(v) for v in resp.json().get("results") or []}
        r.version = versions.pop() if len(versions) == 1 else None
        r.probed = True

    async def _healthy(self, r: _Replica) -> bool:
        import httpx

        try:
            resp = await self._client.get(r.url + "/health", headers=r.headers, timeout=_HEALTH_TIMEOUT)
        except httpx.ConnectError as exc:
            r.failures = _HEALTH_FAILURES  # nothing listens: no point in waiting
            r.last_error = f"health check: {type(exc).__name__}"
            return False
        except httpx.HTTPError as exc:
            r.failures += 1
            r.last_error = f"health check: {type(exc).__name__}"
            return False
        if resp.status_code != 200:
            r.failures += 1
            r.last_error = f"health check: HTTP {resp.status_code}"
            return False
        r.failures = 0
        return True

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
        future = asyncio.run_coroutine_threadsafe(self._generate_all(list(requests)), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        tasks = [asyncio.ensure_future(self._one(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    def _body(self, request: GenerationRequest, r: _Replica) -> dict[str, Any]:
        prompt = [int(t) for t in request.prompt_token_ids]
        if not prompt:
            raise GeneratorError(f"request {request.request_id!r} has an empty prompt")
        s = request.sampling
        max_tokens = s.max_tokens
        if r.max_model_len is not None:
            room = r.max_model_len - len(prompt)
            if room <= 0:
                raise GeneratorError(
                    f"request {request.request_id!r}: its prompt of {len(prompt)} tokens fills the "
                    f"served context of {r.max_model_len} (generator.options.max_model_len)"
                )
            max_tokens = min(max_tokens, room)
        body: dict[str, Any] = {
            "model": r.model,
            "prompt": prompt,
            # vLLM refuses n > 1 with greedy sampling: one greedy completion stands for all.
            "n": request.n if s.temperature > 0 else 1,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if s.top_k > 0:
            body["top_k"] = s.top_k
        if s.stop:
            body["stop"] = list(s.stop)
        if self.send_seed and s.seed is not None:
            body["seed"] = int(s.seed)
        return body

    async def _one(self, request: GenerationRequest) -> list[Completion]:
        import httpx

        attempts = 0
        errors: list[str] = []
        async with self._sem:
            tried: set[int] = set()
            while True:
                r = await self._pick(tried)
                body = self._body(request, r)
                body["request_id"] = f"{request.request_id}-{os.urandom(4).hex()}"
                version, instance, aborts = r.version, r.instance, r.aborts
                assert version is not None, f"replica {r.index} was picked with unknown weights"
                r.outstanding += 1
                r.dispatched += 1
                r.idle.clear()
                try:
                    resp = await self._client.post(r.url + "/v1/completions", json=body, headers=r.headers)
                    if r.aborts != aborts and r.instance == instance:
                        raise _Retry()  # an abort-policy update overlapped it: see _Replica.aborts
                    return self._completions(request, resp, r, version)
                except _Retry:
                    continue  # aborted for a weight update: resubmitted, not a failure
                except (httpx.HTTPError, _ReplicaFailed) as exc:
                    if r.aborts != aborts and r.instance == instance:
                        continue  # the abort of an update broke the request: resubmit
                    attempts += 1
                    why = f"{type(exc).__name__}: {exc}".strip()
                    errors.append(f"replica {r.index}: {why}")
                    if r.instance == instance:
                        self._take_out(r, why)
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

    def _completions(
        self, request: GenerationRequest, resp: httpx.Response, r: _Replica, version: int
    ) -> list[Completion]:
        if resp.status_code >= 500 or resp.status_code in (401, 403):
            # 5xx: the engine failed (it may be dying); 401: the replica restarted with a
            # new key. Either way another replica (or the restarted one) should answer.
            raise _ReplicaFailed(f"HTTP {resp.status_code}: {_error_message(resp)}")
        if resp.status_code != 200:
            raise GeneratorError(
                f"vLLM rejected request {request.request_id!r} (HTTP {resp.status_code}): {_error_message(resp)}"
            )
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        if any(c.get("finish_reason") == "abort" for c in choices):
            # Not one of our updates (those are caught by _Replica.aborts): the server's own.
            raise _ReplicaFailed("the server aborted the request")
        if request.sampling.temperature <= 0 and len(choices) == 1:
            choices = choices * request.n  # greedy: every completion is the same
        if len(choices) != request.n:
            raise GeneratorError(
                f"request {request.request_id!r}: asked for {request.n} completions, got {len(choices)}"
            )
        out = []
        for c in choices:
            tokens = [int(t) for t in c.get("token_ids") or []]
            logprobs = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
            if len(logprobs) != len(tokens):
                raise GeneratorError(
                    f"request {request.request_id!r}: vLLM returned {len(tokens)} tokens but "
                    f"{len(logprobs)} logprobs"
                )
            finish = _FINISH.get(str(c.get("finish_reason")), "stop")
            out.append(Completion(tokens, logprobs, finish, version, c.get("text") or ""))
        return out

    async def _pick(self, tried: set[int]) -> _Replica:
        """The ready replica with the fewest requests in flight; waits (up to the start-up
        timeout: long enough for a restart) while none is ready."""
        deadline = time.monotonic() + self.options.startup_timeout
        async with self._changed:
            while True:
                if self._closed:
                    raise GeneratorError("the vllm generator is closed")
                ready = [r for r in self._replicas if self._serves(r)]
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

    def _serves(self, r: _Replica) -> bool:
        # version > current happens for a moment during an update (this replica is done,
        # others are not): its completions report the newer version, which is right.
        return r.up and not r.updating and r.version is not None and r.version >= self._version

    def _take_out(self, r: _Replica, why: str) -> None:
        if r.up:
            log.warning("vllm: taking replica %d out of service: %s", r.index, why)
        r.up = False
        r.failures = _HEALTH_FAILURES
        r.last_error = why

    # ------------------------------------------------------------------- weights

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

    async def _update_replica(self, r: _Replica, version: int, policy: str | None = None) -> None:
        """Pause ``r`` by ``policy`` (default: the configured one), load ``version``, reset
        its prefix cache and resume it. The caller has set ``r.updating``."""
        import httpx

        policy = policy or self.options.update_policy
        paused = False
        try:
            if policy == "abort":
                # Before the pause: every request in flight now may be aborted, or queued
                # and run on the new weights; _one resubmits all of them.
                r.aborts += 1
                await self._admin(r, "/pause", params={"mode": "abort"})
            else:
                await r.idle.wait()  # our requests on it finish with the weights they started with
                await self._admin(r, "/pause", params={"mode": "wait"})
            paused = True
            await self._load(r, version)
        except httpx.HTTPError as exc:
            # It stopped answering mid-update: what it holds is unknown.
            r.version = None
            self._take_out(r, f"weight update: {type(exc).__name__}: {exc}")
            raise
        finally:
            try:
                if paused and r.up:
                    await self._admin(r, "/reset_prefix_cache")
                    await self._admin(r, "/resume")
            except httpx.HTTPError as exc:
                self._take_out(r, f"resume after update: {type(exc).__name__}")
            r.updating = False

    async def _load(self, r: _Replica, version: int) -> None:
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
        resp = await self._client.post(
            r.url + "/collective_rpc",
            json={
                "method": "forge_load_weights",
                "args": [json.dumps(request)],
                "timeout": timeout + _LOAD_MARGIN,
            },
            headers=r.headers,
            timeout=timeout + 2 * _LOAD_MARGIN,
        )
        if resp.status_code != 200:
            r.version = None
            raise TransportError(
                f"replica {r.index}: collective_rpc HTTP {resp.status_code}: {_error_message(resp)}"
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

    async def _admin(self, r: _Replica, path: str, params: dict[str, str] | None = None) -> None:
        # Our own requests are drained or aborted before a pause, so these answer at once
        # on a live server; one that does not is hung (its launcher replaces it).
        resp = await self._client.post(r.url + path, params=params, headers=r.headers, timeout=_ADMIN_TIMEOUT)
        resp.raise_for_status()

    # ----------------------------------------------------------------- watching

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
                log.exception("vllm: replica watcher failed; continuing")
            await asyncio.sleep(self.options.health_interval)

    async def _check(self, r: _Replica) -> None:
        import httpx

        data = _read_endpoint(endpoint_file(self.run_dir, r.index))
        if data is not None and not data.get("error") and data.get("instance") != r.instance:
            log.info("vllm: replica %d (re)started at %s:%s", r.index, data.get("host"), data.get("port"))
            self._attach(r, data)
        elif data is None and r.up and r.updating is False:
            # The launcher removes its file when its server exits.
            self._take_out(r, "its endpoint file is gone (server exited)")
            return
        if r.instance is None or r.updating:
            return
        if await self._healthy(r):
            if not r.up:
                try:
                    if r.max_model_len is None:
                        await self._fetch_model_info(r)
                    if not r.probed:
                        await self._probe_version(r)
                except httpx.HTTPError as exc:
                    r.last_error = f"{type(exc).__name__}: {exc}"
                    return
                log.info("vllm: replica %d answers at %s (weights version %s)", r.index, r.url, r.version)
                r.last_error = ""
            r.up = True
        elif r.failures >= _HEALTH_FAILURES and r.up:
            self._take_out(r, r.last_error)

    async def _resync(self, r: _Replica) -> None:
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

    # ------------------------------------------------------------------ health

    def health(self) -> GeneratorHealth:
        serving = [r for r in self._replicas if self._serves(r)]
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
                "serving": self._serves(r),
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

        if self._thread.is_alive():
            try:
                self._call(shutdown(), timeout=10)
            except Exception:
                log.debug("vllm: shutdown of the HTTP client failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()


class _ReplicaFailed(Exception):
    """The replica answered, but not with a usable result (5xx, 401, aborted)."""


def _process_start_time() -> float:
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


def _read_endpoint(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    return str(data)[:300]


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
