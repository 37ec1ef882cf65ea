"""Code that runs inside vLLM's workers: receiving and loading new weights.

vLLM mixes :class:`ForgeWorkerExtension` into its worker class (``--worker-extension-cls``);
the generator calls its methods on every worker of a replica through the server's
``POST /collective_rpc`` (dev mode). Arguments travel as JSON strings (the HTTP endpoint
passes only strings) and tensors never cross it: each worker builds the run's transport
receiver itself and pulls the weights.

Loading goes through the worker's ``reload_weights`` (vLLM's layer-wise in-place reload),
not ``model.load_weights``: on CPU, vLLM repacks linear weights after loading and only
the reload path repeats that. A tied ``lm_head`` is the exception: its packed copy is
made from the embedding matrix and is not refreshed by the reload, so it is packed again
here (without it, a CPU server keeps sampling from the old output layer).

With a LoRA trainer (``"adapter"`` in the request) a version holds only the adapter's
tensors: they are loaded in place as the worker's one LoRA adapter (:mod:`.adapter`),
and the base weights stay as they are. Version 0 is an all-zero adapter
(:meth:`ForgeWorkerExtension.forge_zero_adapter`), so that requests name the adapter
from the first one on. On a shared fleet's server (``"adapter_name"`` in the request)
each run's adapter is kept under its own name, with a receiver per run, and loaded
through vLLM's loader when the generator registers the version (:class:`.adapter.NamedAdapters`).

**Staging** (:meth:`ForgeWorkerExtension.forge_stage_weights`, full weights only): the
version is read from the transport by a thread of the worker while the engine still
generates (an RPC blocks the engine's loop only for as long as it runs, so the RPC just
starts the thread, and is asked again until the read is done); the load under the pause
then takes the tensors from memory. The staged tensors are one more copy of the weights
in host memory, from the stage until the load is done.

**Packing ahead** (``"prepack": true`` in the request, with staging, on a CPU server):
once read, the same thread builds the new packed linear layers beside the serving ones
(:mod:`.prepack`), so that the load under the pause only swaps them in and copies the
unpacked tensors in place, instead of vLLM's layer-by-layer reload. Where the model is
not what that expects (:class:`.prepack.Unsupported`, said once in the worker's log) the
load goes through the reload as without it. One more packed copy of the linear weights
exists from the stage to the swap.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

#: Why a version was not packed ahead, each said once in the worker's log.
_FALLBACKS_LOGGED: set[str] = set()


class _Counted:
    """Wraps a (name, tensor) iterator, counting what passes through it and the time spent
    producing it (the transport's share of a load; the rest is vLLM's)."""

    def __init__(self, items: Iterable[tuple[str, Any]]) -> None:
        self._items = iter(items)
        self.tensors = 0
        self.bytes = 0
        self.read_seconds = 0.0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while True:
            start = time.perf_counter()
            try:
                name, tensor = next(self._items)
            except StopIteration:
                return
            finally:
                self.read_seconds += time.perf_counter() - start
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class _Staging:
    """One version being read from the transport by a thread (:meth:`ForgeWorkerExtension.forge_stage_weights`)."""

    def __init__(self, version: int, receiver: Any, timeout: float, model: Any = None) -> None:
        self.version = version
        self.tensors: list[tuple[str, Any]] = []
        self.read_seconds = 0.0
        self.error: str | None = None
        #: Built by :func:`.prepack.build` when ``model`` was given (packing ahead asked
        #: for); else None, and ``fallback`` says why when it was asked for.
        self.prepacked: Any = None
        self.fallback: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._read, args=(receiver, timeout, model), name=f"forge-stage-{version}", daemon=True
        )
        self.thread.start()

    def _read(self, receiver: Any, timeout: float, model: Any) -> None:
        try:
            self._receive(receiver, timeout)
            if self.error is None and model is not None:
                self._prepack(model)
        finally:
            self.done.set()  # whatever happened: the load waiting on it must not wait for ever

    def _receive(self, receiver: Any, timeout: float) -> None:
        start = time.perf_counter()
        try:
            # The transport's own tensors: the shm receiver's are copies of its file, the
            # others' views of the buffer it keeps until its next receive, which comes
            # only with the next version, after this one is loaded.
            self.tensors = list(receiver.receive(self.version, timeout=timeout))
            if not self.tensors:
                raise RuntimeError(f"weights version {self.version} held no tensors")
        except Exception as exc:  # noqa: BLE001 - reported to the generator by the next poll
            self.tensors = []
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.read_seconds = time.perf_counter() - start

    def _prepack(self, model: Any) -> None:
        from . import prepack

        try:
            self.prepacked = prepack.build(model, self.tensors)
        except Exception as exc:  # noqa: BLE001 - the load falls back to vLLM's reload
            self.fallback = str(exc) if isinstance(exc, prepack.Unsupported) else f"{type(exc).__name__}: {exc}"
            if self.fallback not in _FALLBACKS_LOGGED:
                _FALLBACKS_LOGGED.add(self.fallback)
                level = logging.INFO if isinstance(exc, prepack.NothingToPack) else logging.WARNING
                log.log(level, "forgerl: weights not packed ahead, loaded through vLLM's reload: %s", self.fallback)
            return
        self.tensors = []  # built into the new layers: the read copy is no longer needed

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.error is None, "version": self.version, "done": self.done.is_set()}
        if self.error is not None:
            out["error"] = self.error
        return out


class ForgeWorkerExtension:
    """Methods added to each vLLM worker. ``self`` is the worker (``self.rank``,
    ``self.model_runner``, ``self.reload_weights`` come from vLLM)."""

    _forge_version: int = 0
    _forge_receivers: dict[str, Any]
    _forge_staging: _Staging | None = None

    if TYPE_CHECKING:  # pragma: no cover - what the vLLM worker this is mixed into provides
        model_runner: Any

        def reload_weights(
            self, *, weights_iterator: Iterable[tuple[str, Any]] | None, is_checkpoint_format: bool
        ) -> None: ...

    def forge_load_weights(self, request: str) -> dict[str, Any]:
        """Load a weight version. ``request`` is JSON: ``{"version", "timeout",
        "worker_prefix", "source": "transport" | "base", "transport": {"name", "options",
        "spec"}, "adapter": its adapter_config.json, only with a LoRA trainer}``.
        ``source: base`` reloads the model folder the server started from (version 0,
        which no transport ever carried; with an adapter: the all-zero adapter).

        Never raises: returns ``{"ok": False, "error", "weights_touched"}`` on failure, so
        the caller knows whether the old weights are intact (the failure came before the
        first tensor) or the replica must be reloaded before it serves again.
        """
        req = json.loads(request)
        version = int(req["version"])
        start = time.perf_counter()
        counted = _Counted(())
        waited = 0.0
        stage_seconds: float | None = None  # the staged read, done before the pause
        prepacked: Any = None  # the version built before the pause (.prepack), swapped in here
        fallback: str | None = None  # why a version staged for packing ahead was not
        swap_seconds = 0.0
        try:
            adapter = req.get("adapter")
            if adapter is not None:
                counted, waited = self._forge_load_adapter(req, adapter, version, start)
            elif req.get("source") == "base":
                counted.tensors = -1  # unknown, but the weights are being replaced
                self.reload_weights(weights_iterator=None, is_checkpoint_format=True)
            else:
                staged = self._forge_take_staged(version)
                if staged is not None:
                    fallback = staged.fallback
                    prepacked = staged.prepacked
                    counted, stage_seconds = _Counted(staged.tensors), staged.read_seconds
                if prepacked is not None:
                    counted.tensors, counted.bytes = prepacked.tensors, prepacked.bytes
                    waited = time.perf_counter() - start
                    swap_start = time.perf_counter()
                    prepacked.swap()
                    self._forge_after_swap()
                    swap_seconds = time.perf_counter() - swap_start
                else:
                    if staged is None:
                        receiver = self._forge_receiver(req)
                        # The wait for the version (and its timeout) happens in receive(),
                        # before a single tensor reaches the model.
                        counted = _Counted(receiver.receive(version, timeout=float(req["timeout"])))
                    waited = time.perf_counter() - start
                    self.reload_weights(weights_iterator=counted, is_checkpoint_format=True)
                    if counted.tensors == 0:
                        raise RuntimeError(f"weights version {version} held no tensors")
            if adapter is None and prepacked is None:
                # An adapter leaves the base weights, the head among them, as they were;
                # a prepacked version brought the head's new pack with it.
                self._forge_refresh_tied_head()
        except Exception as exc:  # noqa: BLE001 - reported to the generator, which decides
            return {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "weights_touched": counted.tensors != 0,
                "version": self._forge_version,
                "rank": int(getattr(self, "rank", 0)),
            }
        if req.get("adapter_name") is None:  # a fleet's adapters have versions of their own
            self._forge_version = version
        seconds = time.perf_counter() - start
        return {
            "ok": True,
            "version": version,
            "tensors": counted.tensors,
            "bytes": counted.bytes,
            "seconds": seconds,
            # Waiting for the version to appear, reading it, and vLLM's loading and repacking.
            "wait_seconds": waited,
            "read_seconds": counted.read_seconds,
            "load_seconds": seconds - waited - counted.read_seconds,
            "staged": stage_seconds is not None,
            "stage_seconds": stage_seconds or 0.0,
            # Packing ahead: its build before the pause (part of the stage), the swap under it.
            "prepacked": prepacked is not None,
            "prepack_seconds": prepacked.seconds if prepacked is not None else 0.0,
            "swap_seconds": swap_seconds,
            "prepack_fallback": fallback,
            "rank": int(getattr(self, "rank", 0)),
        }

    def forge_stage_weights(self, request: str) -> dict[str, Any]:
        """Start reading version ``request["version"]`` (the same JSON as
        :meth:`forge_load_weights`, full weights from the transport) into memory, or say
        how that read stands: ``{"ok", "version", "done", "error"?}``. Returns at once:
        the engine goes on generating while the thread reads. A failed read is dropped
        (the load then reads from the transport itself and reports the error)."""
        req = json.loads(request)
        version = int(req["version"])
        staging: _Staging | None = self.__dict__.get("_forge_staging")
        if staging is None or staging.version != version:
            if staging is not None and not staging.done.is_set():
                # An older version's read (its update failed) still waits on the transport:
                # never two reads on one receiver. The load waits for it, then reads itself.
                return {"ok": False, "version": version, "done": True,
                        "error": f"the read of version {staging.version} is still running"}  # fmt: skip
            try:
                receiver = self._forge_receiver(req)
            except Exception as exc:  # noqa: BLE001 - reported; the load goes on without staging
                return {"ok": False, "version": version, "done": True, "error": f"{type(exc).__name__}: {exc}"}
            model = self.model_runner.get_model() if req.get("prepack") else None
            staging = self._forge_staging = _Staging(version, receiver, float(req["timeout"]), model)
        status = staging.status()
        if not status["ok"]:
            self._forge_staging = None
        return status

    def _forge_after_swap(self) -> None:
        """What vLLM's reload does after loading (its model runner's caches of values
        computed from the old weights), for a version swapped in without it."""
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            method = getattr(runner, reset, None)
            if method is not None:
                method()

    def _forge_take_staged(self, version: int) -> _Staging | None:
        """The staged read of ``version`` (waited for when still running), or None when
        there is none or it failed; the stage is dropped either way."""
        staging: _Staging | None = self.__dict__.get("_forge_staging")
        self._forge_staging = None
        if staging is None:
            return None
        staging.done.wait()
        if staging.version != version or staging.error is not None:
            return None
        return staging

    def _forge_load_adapter(
        self, req: dict[str, Any], config: dict[str, Any], version: int, start: float
    ) -> tuple[_Counted, float]:
        """Version ``version`` of the LoRA adapter (version 0: all zero); what was read,
        and how long the wait for it took."""
        from . import adapter

        manager = self.model_runner.lora_manager
        name = req.get("adapter_name")  # on a shared fleet's server: kept by name, see adapter.NamedAdapters
        if req.get("source") == "base":
            if name is None:
                adapter.install_zero(manager, int(config["r"]))
            else:
                self._forge_named().drop(str(name))
            return _Counted(()), 0.0
        receiver = self._forge_receiver(req, owner=name)
        counted = _Counted(receiver.receive(version, timeout=float(req["timeout"])))
        waited = time.perf_counter() - start
        tensors = dict(counted)
        if not tensors:
            raise RuntimeError(f"adapter version {version} held no tensors")
        if name is None:
            adapter.install(manager, tensors, config)
        else:
            self._forge_named().keep(str(name), version, tensors, config)
        return counted, waited

    def _forge_named(self) -> Any:
        """The adapters this worker keeps by name (made, and hooked into vLLM's loader, once)."""
        from . import adapter

        named = self.__dict__.get("_forge_named_adapters")
        if named is None:
            named = self._forge_named_adapters = adapter.NamedAdapters(self.model_runner.lora_manager)
        return named

    def forge_adapter_version(self, name: str) -> int:
        """The version of adapter ``name`` this worker keeps (0: none), as
        :meth:`forge_policy_version` for a run on a shared fleet."""
        self._forge_watch_finished()
        if self.__dict__.get("_forge_named_adapters") is None:
            return 0
        return int(self._forge_named().version(name))

    def forge_drop_adapter(self, name: str) -> bool:
        """A run on a shared fleet ended: forget its adapter and close its receivers."""
        if self.__dict__.get("_forge_named_adapters") is not None:
            self._forge_named().drop(name)
        owned: dict[str, list[str]] = self.__dict__.setdefault("_forge_receivers_of", {})
        receivers = self.__dict__.setdefault("_forge_receivers", {})
        for key in owned.pop(name, []):
            receiver = receivers.pop(key, None)
            close = getattr(receiver, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001, S110 - the receiver is dropped either way
                    pass
        return True

    def forge_zero_adapter(self, config: str) -> list[int]:
        """When this worker holds no adapter (a fresh server, at version 0): install the
        all-zero one of the rank in ``config`` (the adapter_config.json, as JSON), so the
        adapter can be named and every request name it. An adapter already held (a server
        met again) is left as it is: the generator knows its version from
        :meth:`forge_policy_version`. Returns the adapter ids held."""
        from . import adapter

        manager = self.model_runner.lora_manager
        if not adapter.loaded(manager):
            adapter.install_zero(manager, int(json.loads(config)["r"]))
        return adapter.loaded(manager)

    def forge_adapters(self) -> list[int]:
        """The LoRA adapter ids this worker holds (the generator checks, after naming the
        adapter to the API server, that its id is the one loaded in place)."""
        from . import adapter

        return adapter.loaded(self.model_runner.lora_manager)

    def forge_policy_version(self) -> int:
        """The weight version this worker last loaded (0: the model folder's). Asked when
        the generator first meets the server, before it sends a request: from then on the
        worker remembers how long the requests that finish were (:meth:`forge_sampled_so_far`)."""
        self._forge_watch_finished()
        return self._forge_version

    def forge_sampled_so_far(self, keys: str) -> dict[str, dict[str, int]]:
        """While the engine is paused in place (``/pause?mode=keep``): how many tokens each
        request sampled so far, for the generator's request ids ``keys`` (a JSON list), as
        ``{key: {choice: count}}``. Exact: a paused engine samples nothing, and every
        request it started is either in the model runner's states (running, preempted, or
        finished at the last step) or among the finished ones remembered since. A request
        left out had not started: all its tokens come after the resume."""
        wanted = set(json.loads(keys))
        self._forge_watch_finished()
        finished: dict[str, int] = self.__dict__.setdefault("_forge_finished", {})
        lengths = dict(finished)
        for req_id, state in self.model_runner.requests.items():
            lengths[req_id] = len(state.output_token_ids)
        out: dict[str, dict[str, int]] = {}
        for req_id, n in lengths.items():
            found = _our_request(req_id, wanted)
            if found is not None:
                key, choice = found
                out.setdefault(key, {})[str(choice)] = n
        return out

    def _forge_watch_finished(self) -> None:
        """Remember the length of each request the model runner forgets (it drops a
        finished request's state one step after it finished, while its answer may still
        be on its way to the generator)."""
        runner = self.model_runner
        if getattr(runner, "_forge_watched", False):
            return
        finished: dict[str, int] = self.__dict__.setdefault("_forge_finished", {})
        removed = runner._on_request_state_removed

        def remember(req_id: str, req_state: Any, *args: Any, **kwargs: Any) -> Any:
            if req_state is not None:
                finished[req_id] = len(req_state.output_token_ids)
                while len(finished) > FINISHED_REMEMBERED:
                    finished.pop(next(iter(finished)))  # the oldest: long answered
            return removed(req_id, req_state, *args, **kwargs)

        runner._on_request_state_removed = remember
        runner._forge_watched = True

    def forge_tied_head_is_current(self) -> bool:
        """True when the output layer computes with the current embedding matrix (a check
        for tests: the tied-embedding trap leaves it computing with an old copy)."""
        import torch

        model = self.model_runner.get_model()
        head, embed = self._forge_head_and_embedding(model)
        if head is None or embed is None or not _shares_weight(head, embed):
            return True
        x = torch.randn(2, embed.weight.shape[1], dtype=embed.weight.dtype)
        want = x @ embed.weight.t()
        cpu_linear = getattr(head, "cpu_linear", None)
        got = cpu_linear(x, head.weight, None) if cpu_linear is not None else want
        return bool(torch.allclose(got[:, : want.shape[1]], want, atol=1e-4, rtol=1e-4))

    # ------------------------------------------------------------------ internals

    def _forge_receiver(self, req: dict[str, Any], owner: Any = None) -> Any:
        """The receiver of the transport ``req`` names (one per transport: on a shared
        fleet's server one per run, remembered under ``owner``, its adapter's name)."""
        transport = req["transport"]
        key = json.dumps(transport, sort_keys=True)
        receivers = self.__dict__.setdefault("_forge_receivers", {})
        if owner is not None:
            owned = self.__dict__.setdefault("_forge_receivers_of", {}).setdefault(str(owner), [])
            if key not in owned:
                owned.append(key)
        if key not in receivers:
            from forgerl.registry.plugins import build_registry

            worker_id = f"{req.get('worker_prefix', 'vllm')}-rank{int(getattr(self, 'rank', 0))}"
            built = build_registry().transport_from(transport["described"])
            receiver = built.receiver(worker_id, transport.get("spec") or {})
            # The folder this server loaded: the receiver's first base, where its transport
            # sends changes (the server's own copy, wherever it runs).
            model = getattr(getattr(self, "model_config", None), "model", None)
            if model and Path(model).is_dir():
                receiver.seed_from(Path(model))
            receivers[key] = receiver
        return receivers[key]

    @staticmethod
    def _forge_head_and_embedding(model: Any) -> tuple[Any, Any]:
        head = getattr(model, "lm_head", None)
        try:
            embed = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            inner = getattr(model, "model", None)
            embed = getattr(inner, "embed_tokens", None)
        return head, embed

    def _forge_refresh_tied_head(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return  # on GPU the head reads the shared parameter directly
        model = self.model_runner.get_model()
        head, embed = self._forge_head_and_embedding(model)
        if head is None or embed is None or not hasattr(head, "cpu_linear"):
            return
        if _shares_weight(head, embed):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(head, remove_weight=False)


#: Finished requests whose lengths a worker remembers (a few steps' worth at any batch size).
FINISHED_REMEMBERED = 1 << 16


def _our_request(req_id: str, keys: set[str]) -> tuple[str, int] | None:
    """``(key, choice)`` when vLLM's internal ``req_id`` is one of our requests ``keys``.
    vLLM 0.32 names the request ``cmpl-<key>-<prompt index>-<8 random chars>`` and the
    ``n`` samples of one request ``<choice>_<that>``."""
    choice, sep, rest = req_id.partition("_")
    if not (sep and choice.isdigit()):
        choice, rest = "0", req_id
    rest = rest.removeprefix("cmpl-")
    for _ in range(2):  # strip the random suffix, then the prompt index
        rest = rest.rpartition("-")[0]
        if rest in keys:
            return rest, int(choice)
    return None


def _shares_weight(head: Any, embed: Any) -> bool:
    if head is embed:
        return True
    hw, ew = getattr(head, "weight", None), getattr(embed, "weight", None)
    if hw is None or ew is None or hw.numel() == 0:
        return False
    return hw is ew or hw.data_ptr() == ew.data_ptr()
