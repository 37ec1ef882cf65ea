"""A TEST DOUBLE of an SGLang server, for machines without a GPU (SGLang has no CPU build).

It is not SGLang. It stands in for ``python -m sglang.launch_server`` so that the sglang
generator's launcher, client, weight updates and failover can be driven on CPU:

* its command line takes the flags the launcher passes, under SGLang's names, and refuses
  any other (argparse: exit status 2);
* its request models carry the field names of ``sglang.srt.managers.io_struct`` (SGLang
  0.5.23) and refuse unknown fields (HTTP 422), so a payload that SGLang would not know
  fails here; where the ``sglang`` package imports, every body is also validated against
  SGLang's own request classes;
* it serves /generate, /health, /health_generate, /model_info, /update_weights_from_disk,
  /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed,
  /end_weight_update, /update_weight_version, /pause_generation, /continue_generation,
  /abort_request, /flush_cache, /load_lora_adapter and /unload_lora_adapter; every route but /health needs the API key (as SGLang
  with --api-key);
* pause, weight versions and the cache behave as SGLang 0.5.23's scheduler does with them
  (``sglang/srt/managers/scheduler.py``, ``utils/weight_versions.py``): a paused engine
  samples nothing and holds new requests before they start; ``in_place`` leaves each
  request its KV (computed by the weights it was computed with), ``retract`` drops it, so
  the request is prefilled again (prompt and tokens so far) when it goes on, with the
  weights of then; ``abort`` aborts every request and returns once none runs. A weight
  version change notes, for each request holding tokens, how many it had sampled, and
  every answer reports the spans (``meta_info.weight_versions``: which version sampled
  which tokens). ``/flush_cache`` (and a load asked to flush) fails while a request
  holds KV: it succeeds when none runs, or while paused by ``retract``. Distributed loads
  need an open weight-update session (``/begin_weight_update``);
* LoRA as SGLang serves it: off unless ``--enable-lora`` (which, without adapters at
  start, needs ``--max-lora-rank`` and ``--lora-target-modules``); an adapter is loaded by
  name from a PEFT folder (``adapter_config.json`` and safetensors), refused when its rank
  or modules exceed the server's, unloaded by name, and applied to exactly the
  generations whose ``lora_path`` names it (``W x + alpha / r * B A x`` on the named
  projections, no merge);
* it computes tokens and logprobs with the model in transformers (fp32, CPU): logprobs are
  ``log_softmax(logits / T)`` of the sampled token, as SGLang's default sampler returns;
* weight updates really load: safetensors of a folder, or tensors received by broadcast
  in a group built as SGLang's ``init_custom_process_group`` builds it (gloo here).

What it cannot prove: that SGLang itself behaves like this (its scheduling, its pause and
abort semantics, its NCCL groups, its numerics). The double's own routes, for tests:
``GET /double/calls`` lists the admin calls received, in order; ``POST /double/gate``
(``{"closed": true|false, "after": N}``) closes or opens a gate that generations wait at
once they have sampled N tokens (default 0: before their first), and ``GET /double/held``
counts the generations waiting there (and those running and finished). An abort (``/pause_generation`` mode abort,
``/abort_request``) opens the gate, so a test can hold requests in flight until the
update it sends, whatever the machine's speed; a held generation is still a running
request to pauses, weight versions and flushes.
``POST /double/wedge`` wedges its engine for good, as a stuck CUDA or NCCL call does: the
engine lock is taken and never given back, so no generation (``/health_generate`` included)
and no weight load runs again, while the HTTP server and ``/health`` go on answering.

Run: ``python tests/helpers/sglang_double.py --model-path DIR --port P --api-key K ...``
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

#: The request id of /health_generate's own generation (never held at the tests' gate).
HEALTH_PROBE_RID = "double-health-probe"
#: Seconds /health_generate waits for its token (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_CHECK_S = 20.0


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Base(Strict):  # io_struct.BaseReq
    rid: str | None = None
    http_worker_ipc: str | None = None


class SamplingParams(Strict):  # sglang.srt.sampling.sampling_params.SamplingParams (what we use)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    n: int = 1


class GenerateReqInput(Strict):
    rid: str | None = None
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    stream: bool = False
    lora_path: str | None = None  # the name of a loaded adapter (SGLang's field name)


class LoadLoRAAdapterReqInput(Base):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(Base):
    lora_name: str
    lora_id: str | None = None


class UpdateWeightFromDiskReqInput(Base):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class InitWeightsUpdateGroupReqInput(Base):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(Base):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class BeginWeightUpdateReqInput(Base):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(Base):
    pass


class UpdateWeightVersionReqInput(Base):
    new_version: str
    abort_all_requests: bool = True


class PauseGenerationReqInput(Base):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(Base):
    torch_empty_cache: bool = True


class AbortReq(Base):
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


def sglang_check(name: str, body: dict[str, Any]) -> None:
    """Validate ``body`` against SGLang's own request class ``name``, where SGLang imports."""
    try:
        from pydantic import TypeAdapter
        from sglang.srt.managers import io_struct  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed (or not importable without CUDA)
        return
    TypeAdapter(getattr(io_struct, name)).validate_python(body)


#: The projections SGLang serves LoRA on in this model family (--lora-target-modules names).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: A PEFT adapter tensor's name: ``base_model.model.<module>.lora_A.weight`` (or lora_B).
_LORA_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


class LoraSlots:
    """What ``--enable-lora``, ``--max-lora-rank`` and ``--lora-target-modules`` fix at
    start (SGLang sizes its adapter memory pool by them)."""

    def __init__(self, max_rank: int, targets: set[str]) -> None:
        self.max_rank = max_rank
        self.targets = targets


class Adapter:
    """A loaded LoRA adapter: ``(A, B)`` per module (its dotted name in the model) and
    its scale ``alpha / r``."""

    def __init__(self, name: str, path: str, layers: dict[str, tuple[Any, Any]], scale: float) -> None:
        self.name = name
        self.path = path
        self.layers = layers
        self.scale = scale


class Live:
    """One request the engine holds (SGLang's ``Req``): the tokens it has sampled, the
    weight-version changes it ran across (the old version and its tokens then), and
    whether a retract dropped its KV."""

    def __init__(self, rid: str | None) -> None:
        self.rid = rid
        self.out: list[tuple[float, int, None]] = []
        self.events: list[tuple[str, int]] = []
        self.retracted = False


def version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict[str, Any]]:
    """SGLang's ``compute_weight_version_spans``: which version sampled which of ``n`` tokens."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class Engine:
    """The model, its weights' version, LoRA adapters, and pause/abort state."""

    FLUSH_REFUSED = (
        "Weights were updated, but the cache was not flushed because requests are still running or "
        "queued. Retract or finish them, then call /flush_cache."
    )

    def __init__(self, model_path: str, version: str, lora: LoraSlots | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos: set[int] = set()
        try:
            value = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            value = None
        for v in (value, self.tokenizer.eos_token_id):
            eos.update([v] if isinstance(v, int) else (v or []))
        self.eos = eos
        self.model_path = model_path
        self.version = version
        self.lock = threading.Lock()  # one forward pass (or weight load) at a time
        self.changed = threading.Condition(self.lock)  # pause, resume, abort, a request ended
        self.paused: str | None = None  # the pause mode while paused
        self.live: dict[int, Live] = {}  # the requests it holds, by id()
        self.aborted: set[str] = set()
        self.abort_all_epoch = 0
        self.session = False  # a weight-update session is open (/begin_weight_update)
        self.gate = threading.Event()  # the tests' gate (module docstring); open
        self.gate.set()
        self.gate_after = 0
        self.held = 0  # generations waiting at the closed gate
        self.finished = 0  # generations that ended (the liveness probe's not counted)
        self.requests = ThreadPoolExecutor(max_workers=64, thread_name_prefix="double-generate")
        self.groups: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []
        self.lora = lora
        self.adapters: dict[str, Adapter] = {}
        self.active: Adapter | None = None  # the adapter of the forward pass under way (under the lock)
        self.lora_modules: dict[str, Any] = {}
        if lora is not None:
            head = self.model.get_output_embeddings()
            for name, module in self.model.named_modules():
                if isinstance(module, torch.nn.Linear) and module is not head and name.rpartition(".")[2] in lora.targets:
                    self.lora_modules[name] = module
                    module.register_forward_hook(self._lora_hook(name))

    def _lora_hook(self, name: str) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> Any:
            adapter = self.active
            if adapter is None or name not in adapter.layers:
                return None
            a, b = adapter.layers[name]
            return output + (inputs[0] @ a.T @ b.T) * adapter.scale

        return hook

    def adapter_for(self, name: str | None) -> Adapter | None:
        """The adapter a generation names (SGLang's errors for a name it cannot serve)."""
        if name is None:
            return None
        if self.lora is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(
                f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {list(self.adapters)}."
            )
        return adapter

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter in folder ``path`` as ``name``; ValueError as SGLang refuses."""
        import torch
        from safetensors.torch import load_file

        if self.lora is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.adapters:
            raise ValueError(f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)}")
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the adapter_config.json of LoRA adapter {name} in {path}: {exc}") from exc
        if str(config.get("peft_type", "")).lower() != "lora" or config.get("use_dora"):
            raise ValueError(f"LoRA adapter {name}: peft_type {config.get('peft_type')!r} is not LoRA")
        rank, alpha, modules = int(config["r"]), float(config["lora_alpha"]), config["target_modules"]
        kinds = {m.rpartition(".")[2] for m in modules}
        if rank > self.lora.max_rank or not kinds <= self.lora.targets:
            raise ValueError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                f"configuration (max_lora_rank={self.lora.max_rank}, target_modules={sorted(self.lora.targets)})"
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors in {path}")
        parts: dict[str, dict[str, Any]] = {}
        for f in files:
            for tensor_name, t in load_file(str(f)).items():
                found = _LORA_TENSOR.fullmatch(tensor_name)
                module = found.group(1) if found else None
                if found is None or module not in self.lora_modules or module.rpartition(".")[2] not in kinds:
                    raise ValueError(f"LoRA adapter {name}: tensor {tensor_name!r} names no LoRA module it targets")
                parts.setdefault(module, {})[found.group(2)] = t.to(torch.float32)
        layers = {}
        for module, ab in parts.items():
            linear = self.lora_modules[module]
            want = {"A": (rank, linear.in_features), "B": (linear.out_features, rank)}
            if set(ab) != {"A", "B"} or any(tuple(ab[k].shape) != want[k] for k in ab):
                raise ValueError(f"LoRA adapter {name}: {module} has {({k: tuple(v.shape) for k, v in ab.items()})}, "
                                 f"expected A {want['A']} and B {want['B']}")
            layers[module] = (ab["A"], ab["B"])
        with self.lock:
            self.adapters[name] = Adapter(name, path, layers, alpha / rank)

    def unload_lora(self, name: str) -> None:
        if self.lora is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        with self.lock:
            if self.adapters.pop(name, None) is None:
                raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")

    def generate(self, req: GenerateReqInput) -> dict[str, Any]:
        import torch

        s = req.sampling_params
        gen = torch.Generator()
        gen.manual_seed(s.sampling_seed if s.sampling_seed is not None else int.from_bytes(__import__("os").urandom(4)))
        past = None
        finish: dict[str, Any] = {"type": "length", "length": s.max_new_tokens}
        # A generation keeps the adapter it started with (SGLang: an unload waits for it).
        adapter = self.adapter_for(req.lora_path)
        with self.changed:  # a paused server holds new requests before they reach its scheduler
            self.changed.wait_for(lambda: self.paused is None)
            epoch = self.abort_all_epoch
            live = Live(req.rid)
            self.live[id(live)] = live
        out = live.out
        ids: Any = None
        try:
            while len(out) < s.max_new_tokens:
                # The tests' gate holds their generations, not the launcher's liveness probe: a
                # probe held there would count as one of the test's samples and, held past the
                # liveness timeout, get the server killed as wedged.
                if len(out) == self.gate_after and not self.gate.is_set() and req.rid != HEALTH_PROBE_RID:
                    with self.lock:
                        self.held += 1
                    self.gate.wait()
                    with self.lock:
                        self.held -= 1

                def stopped() -> bool:
                    return self.abort_all_epoch != epoch or bool(req.rid and req.rid in self.aborted)

                with self.changed:
                    self.changed.wait_for(lambda: self.paused is None or stopped())
                    if stopped():
                        finish = {"type": "abort", "message": "aborted", "status_code": 400}
                        break
                    if live.retracted:  # its KV was dropped: prefilled again, by the weights of now
                        past, live.retracted = None, False
                    if past is None:
                        ids = torch.tensor([req.input_ids + [t for _, t, _ in out]])
                    self.active = adapter
                    try:
                        with torch.no_grad():
                            result = self.model(ids, past_key_values=past, use_cache=True)
                    finally:
                        self.active = None
                    past = result.past_key_values
                    logits = result.logits[0, -1].float()
                    tok, logprob = self.sample(logits, s, gen)
                    out.append((logprob, tok, None))
                ids = torch.tensor([[tok]])
                if tok in self.eos:
                    finish = {"type": "stop", "matched": tok}
                    break
            with self.lock:
                spans = version_spans(live.events, self.version, len(out))
        finally:
            with self.changed:
                del self.live[id(live)]
                self.finished += req.rid != HEALTH_PROBE_RID
                self.changed.notify_all()
        tokens = [t for _, t, _ in out]
        return {
            "text": self.tokenizer.decode(tokens, skip_special_tokens=s.skip_special_tokens),
            "output_ids": tokens,
            "meta_info": {
                "id": req.rid,
                "finish_reason": finish,
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(tokens),
                "weight_version": spans[-1]["version"],
                "weight_versions": spans,
                "output_token_logprobs": [list(t) for t in out] if req.return_logprob else None,
            },
        }

    @staticmethod
    def sample(logits: Any, s: SamplingParams, gen: Any) -> tuple[int, float]:
        import torch

        if s.temperature <= 0:
            tok = int(torch.argmax(logits))
            return tok, float(torch.log_softmax(logits, -1)[tok])
        logprobs = torch.log_softmax(logits / s.temperature, -1)
        probs = logprobs.exp()
        if s.top_k > 0:
            cut = torch.topk(probs, min(s.top_k, probs.numel())).values[-1]
            probs = torch.where(probs >= cut, probs, torch.zeros_like(probs))
        if s.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        return tok, float(logprobs[tok])

    def set_version(self, version: str) -> None:
        """SGLang's ``record_weight_version_change``; the caller holds the lock."""
        if version == self.version:
            return
        for live in self.live.values():
            if live.out:
                live.events.append((self.version, len(live.out)))
        self.version = version

    def can_flush(self) -> bool:
        """SGLang's ``flush_cache``: nothing may hold KV (retracted requests hold none). The
        launcher's one-token liveness probe is excused: caught by a pause, SGLang would
        refuse too, but the launcher stops probing while the generator's update notice is
        fresh, and tests must not hinge on when its last probe ran."""
        running = [live for live in self.live.values() if live.rid != HEALTH_PROBE_RID]
        return not running or self.paused == "retract"

    def pause(self, mode: str) -> None:
        with self.changed:
            self.paused = mode
            if mode == "abort":
                self.abort_all_epoch += 1
            if mode == "retract":
                for live in self.live.values():
                    live.retracted = True
            self.changed.notify_all()
        if mode == "abort":
            self.gate.set()  # what waited at the gate sees the abort
            with self.changed:  # as SGLang's: returns once no request runs
                self.changed.wait_for(lambda: not self.live, timeout=60)

    def resume(self) -> None:
        with self.changed:
            self.paused = None
            self.changed.notify_all()

    def abort(self, rid: str | None, abort_all: bool) -> None:
        with self.changed:
            if abort_all:
                self.abort_all_epoch += 1
            elif rid:
                self.aborted.add(rid)
            self.changed.notify_all()
        self.gate.set()

    def load(self, named: Any, version: str | None) -> int:
        # state_dict, not named_parameters: a tied lm_head.weight is listed there too.
        params = self.model.state_dict(keep_vars=True)
        count = 0
        with self.lock:
            for name, tensor in named:
                if name not in params:
                    raise ValueError(f"unknown parameter {name!r}")
                params[name].data.copy_(tensor.to(params[name].dtype))
                count += 1
            if version is not None:
                self.set_version(version)
        return count

    def join(self, req: InitWeightsUpdateGroupReqInput) -> None:
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            rendezvous,
        )

        wait = timedelta(seconds=120)
        rank = req.rank_offset  # one worker (tp 1 on CPU)
        store, rank, world = next(rendezvous(f"tcp://{req.master_address}:{req.master_port}", rank, req.world_size, timeout=wait))
        store.set_timeout(wait)
        made = _new_process_group_helper(
            world, rank, [], Backend("gloo"), PrefixStore(req.group_name, store), group_name=req.group_name, timeout=wait
        )
        self.groups[req.group_name] = made[0] if isinstance(made, tuple) else made

    def receive(self, req: UpdateWeightsFromDistributedReqInput) -> int:
        import torch
        import torch.distributed as dist

        pg = self.groups[req.group_name]
        received = []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([t], opts).wait()
            received.append((name, t))
        return self.load(received, req.weight_version)


def build_app(engine: Engine, api_key: str | None) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if api_key and not request.url.path.startswith("/health"):
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    def record(path: str, body: BaseModel) -> None:
        engine.calls.append({"path": path, **body.model_dump(exclude_none=True)})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # As SGLang's: one greedy token through the engine, 503 when none comes in time.
        probe = GenerateReqInput(rid=HEALTH_PROBE_RID, input_ids=[0],
                                 sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(engine.requests, engine.generate, probe), HEALTH_CHECK_S)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.post("/double/wedge")
    async def wedge() -> dict[str, bool]:
        await asyncio.to_thread(engine.lock.acquire)  # never released: the engine is stuck
        return {"wedged": True}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "weight_version": engine.version, "is_generation": True}

    @app.get("/double/calls")
    async def calls() -> list[dict[str, Any]]:
        return engine.calls

    @app.post("/double/gate")
    async def gate(body: dict[str, int]) -> dict[str, bool]:
        if body.get("closed"):
            engine.gate_after = int(body.get("after", 0))
            engine.gate.clear()
        else:
            engine.gate.set()
        return {"closed": not engine.gate.is_set()}

    @app.get("/double/held")
    async def held() -> dict[str, int]:
        running = sum(live.rid != HEALTH_PROBE_RID for live in list(engine.live.values()))
        return {"held": engine.held, "running": running, "finished": engine.finished}

    @app.post("/generate")
    async def generate(req: GenerateReqInput) -> Any:
        sglang_check("GenerateReqInput", req.model_dump(exclude_none=True))
        # A thread per request, not asyncio's default pool (cores + 4 threads): requests
        # held at the gate must not keep others from reaching it.
        try:
            return await asyncio.get_running_loop().run_in_executor(engine.requests, engine.generate, req)
        except ValueError as exc:  # as SGLang answers a request it refuses
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    def lora_answer(error: str | None) -> JSONResponse:  # SGLang's LoRAUpdateOutput
        body = {"success": error is None, "error_message": error,
                "loaded_adapters": {n: a.path for n, a in engine.adapters.items()}}
        return JSONResponse(body, status_code=200 if error is None else 400)

    @app.post("/load_lora_adapter")
    async def load_lora(req: LoadLoRAAdapterReqInput) -> JSONResponse:
        record("/load_lora_adapter", req)
        sglang_check("LoadLoRAAdapterReqInput", req.model_dump(exclude_none=True))
        try:
            await asyncio.to_thread(engine.load_lora, req.lora_name, req.lora_path)
        except ValueError as exc:
            return lora_answer(str(exc))
        return lora_answer(None)

    @app.post("/unload_lora_adapter")
    async def unload_lora(req: UnloadLoRAAdapterReqInput) -> JSONResponse:
        record("/unload_lora_adapter", req)
        sglang_check("UnloadLoRAAdapterReqInput", req.model_dump(exclude_none=True))
        try:
            await asyncio.to_thread(engine.unload_lora, req.lora_name)
        except ValueError as exc:
            return lora_answer(str(exc))
        return lora_answer(None)

    def answer(ok: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    @app.post("/update_weights_from_disk")
    async def from_disk(req: UpdateWeightFromDiskReqInput) -> JSONResponse:
        record("/update_weights_from_disk", req)
        sglang_check("UpdateWeightFromDiskReqInput", req.model_dump(exclude_none=True))

        def load() -> int:
            from safetensors.torch import load_file

            files = sorted(Path(req.model_path).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no safetensors in {req.model_path}")
            named = [kv for f in files for kv in load_file(str(f)).items()]
            return engine.load(named, req.weight_version)

        try:
            n = await asyncio.to_thread(load)
        except Exception as exc:  # noqa: BLE001 - reported like SGLang: success false
            return answer(False, f"{type(exc).__name__}: {exc}")
        if req.flush_cache and not engine.can_flush():  # loaded and renamed, but not flushed
            return answer(False, engine.FLUSH_REFUSED)
        return answer(True, f"loaded {n} tensors")

    @app.post("/init_weights_update_group")
    async def init_group(req: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        record("/init_weights_update_group", req)
        sglang_check("InitWeightsUpdateGroupReqInput", req.model_dump(exclude_none=True))
        try:
            await asyncio.to_thread(engine.join, req)
        except Exception as exc:  # noqa: BLE001
            return answer(False, f"{type(exc).__name__}: {exc}")
        return answer(True, "joined")

    @app.post("/begin_weight_update")
    async def begin_update(req: BeginWeightUpdateReqInput) -> JSONResponse:
        record("/begin_weight_update", req)
        sglang_check("BeginWeightUpdateReqInput", req.model_dump(exclude_none=True))
        if engine.session:
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        engine.session = True
        return answer(True, "Success")

    @app.post("/end_weight_update")
    async def end_update(req: EndWeightUpdateReqInput) -> JSONResponse:
        record("/end_weight_update", req)
        sglang_check("EndWeightUpdateReqInput", req.model_dump(exclude_none=True))
        if not engine.session:
            return answer(False, "no weight-update session is open; call begin_weight_update() first")
        engine.session = False
        return answer(True, "Success")

    @app.post("/update_weights_from_distributed")
    async def from_distributed(req: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        record("/update_weights_from_distributed", req)
        sglang_check("UpdateWeightsFromDistributedReqInput", req.model_dump(exclude_none=True))
        if not engine.session:
            return answer(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        try:
            n = await asyncio.to_thread(engine.receive, req)
        except Exception as exc:  # noqa: BLE001
            return answer(False, f"{type(exc).__name__}: {exc}")
        if req.flush_cache and not engine.can_flush():
            return answer(False, engine.FLUSH_REFUSED)
        return answer(True, f"received {n} tensors")

    @app.post("/update_weight_version")
    async def weight_version(req: UpdateWeightVersionReqInput) -> JSONResponse:
        record("/update_weight_version", req)
        sglang_check("UpdateWeightVersionReqInput", req.model_dump(exclude_none=True))
        if req.abort_all_requests:
            engine.abort(None, abort_all=True)
        with engine.lock:
            engine.set_version(req.new_version)
        return JSONResponse({"success": True, "new_version": req.new_version})

    @app.post("/pause_generation")
    async def pause(req: PauseGenerationReqInput) -> dict[str, str]:
        record("/pause_generation", req)
        sglang_check("PauseGenerationReqInput", req.model_dump(exclude_none=True))
        await asyncio.to_thread(engine.pause, req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(req: ContinueGenerationReqInput) -> dict[str, str]:
        record("/continue_generation", req)
        sglang_check("ContinueGenerationReqInput", req.model_dump(exclude_none=True))
        await asyncio.to_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort(req: AbortReq) -> Response:
        record("/abort_request", req)
        sglang_check("AbortReq", req.model_dump(exclude_none=True))
        await asyncio.to_thread(engine.abort, req.rid, req.abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> Response:
        engine.calls.append({"path": "/flush_cache"})
        if not engine.can_flush():  # SGLang answers 400 with the reason
            return Response(content="Cache not flushed: requests are running.\n", status_code=400)
        return Response(content="Cache flushed.\n", status_code=200)

    return app


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang_double (NOT SGLang)")
    # SGLang's flag names (its ServerArgs fields); anything else is refused.
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--sampling-backend", default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    return parser


def lora_slots(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LoraSlots | None:
    """The LoRA pool the flags ask for; SGLang's own refusals (exit status 2 here)."""
    if not args.enable_lora:
        return None
    targets = set(args.lora_target_modules or ())
    if targets == {"all"}:
        targets = set(LORA_MODULES)
    if not (args.max_lora_rank and targets):
        parser.error("When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                     "and --lora-target-modules for LoRA initialization.")
    unknown = targets - set(LORA_MODULES)
    if unknown:
        parser.error(f"--lora-target-modules: {sorted(unknown)} are not modules the double serves LoRA on")
    return LoraSlots(args.max_lora_rank, targets)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    flags = parser()
    args = flags.parse_args(argv)
    engine = Engine(args.model_path, args.weight_version, lora_slots(args, flags))
    uvicorn.run(build_app(engine, args.api_key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
