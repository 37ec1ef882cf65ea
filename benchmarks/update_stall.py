"""Generation stall per weight update, by update policy, in a running vLLM server.

Run: .venv/bin/python benchmarks/update_stall.py [--model smollm2-135m-instruct]
     [--rounds 3] [--order concurrent|staged|both] [--staging on|off|both] [--prepack on|off|both]
     [--policies wait,abort,keep] [--streams 4] [--max-tokens 96] [--lora-rank 16] [--json]

One server is started by the plugin's role (as ``forge run`` does, through the helpers of
benchmarks/vllm_weight_update.py); the benchmark plays trainer rank 0: it keeps
``--streams`` requests in flight all the time (the arithmetic task's prompts, T = 1), and
after a first update that is not measured (the worker builds its transport receiver
then), every few seconds it sends a new version of the weights (fp32, Hugging Face names,
through the shm transport) while ``VLLMGenerator.update_weights`` loads it, exactly as the
loop's ``sync_weights`` does. The update policies ``wait``, ``abort`` and ``keep`` take
turns, update by update, so the machine's load falls on each alike.

Measured per update, as the generator sees it (its engine adapter's calls, timed):

* ``drain``: from the update's start to the pause (``wait`` only: the replica takes no new
  request and lets those in flight finish; under ``abort`` and ``keep`` it pauses at once);
* ``stall``: from the pause to the end of the resume: nothing is sampled then. Split into
  ``counts`` (``keep``: the workers' token counts of the frozen requests), the load as the
  vLLM worker reports it (``wait`` for the bytes, ``read`` them, vLLM ``load`` + repack), and
  the rest (pause, the load RPC, prefix-cache reset, resume), also in its parts: the pause
  call (which returns once the engine's step in progress ends), the load RPC beyond the
  worker's own time, and the resume call (prefix-cache reset and resume);
* the trainer side: ``export`` (the state dict the sender is handed; a plain one-process
  model here, so next to nothing: the fsdp trainer's gather is measured by
  benchmarks/trainer_backends.py) and ``send`` (writing the version to /dev/shm).

``--order``: ``concurrent`` starts the load and the send together (what the loop does
today: the pause comes first, so the stall includes waiting for the trainer's bytes);
``staged`` sends the version first and only then calls ``update_weights`` (the shm
transport keeps it for a late receiver), so the stall is the worker's read and load alone.
``--staging`` (the generator's ``stage_updates``): ``on``, the workers read the version
from the transport before the pause while the replica generates (``stage``: how long that
took, as the generator saw it; not in the stall), and the pause holds the load alone;
``off``: they read it under the pause. ``both`` takes turns, update by update, so both
see the same load. ``--prepack`` (the generator's ``prepack_updates``, with staging on):
``on``, the workers also build the new packed linear layers before the pause (``prepack``,
part of ``stage``) and the load only swaps them in (``swap``); ``off``, the load is vLLM's
reload of the staged tensors; ``both`` takes turns (the staging labels ``prepack`` and
``on``). Also counted: requests resubmitted (``abort``) and completions labelled with two versions
(``keep``). After the last update one completion is checked against transformers.

``--lora-rank R``: full weights against a LoRA adapter of rank R on every block projection
(what ``trainer.options.lora.rank=R`` trains and exports: A and B alone, PEFT's names), side
by side. Each has its own server (the LoRA one started with LoRA on, as a run with that
option starts it, serving the all-zero adapter at version 0); they take turns update by
update (``mode`` ``full``, then ``lora``), each with the traffic on its own server only
(the other's streams stop and its requests finish first), so the machine's load falls on
both alike. An adapter is always read under the pause (``--staging on`` stages full
weights only).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_servers import model_folder, plugin_servers, resolved_config
from vllm_throughput import prompts_for
from vllm_weight_update import check_logprobs

POLICIES = ("wait", "abort", "keep")


class Timed:
    """The engine adapter's pause, token counts, load and resume, timed (perf_counter)."""

    STEPS = ("stage", "pause", "sampled_so_far", "load", "resume")

    def __init__(self, engine: Any) -> None:
        self.marks: list[tuple[str, float, float]] = []
        for name in self.STEPS:
            original = getattr(engine, name)

            async def timed(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await _original(*args, **kwargs)
                finally:
                    self.marks.append((_name, start, time.perf_counter()))

            setattr(engine, name, timed)

    def take(self) -> list[tuple[str, float, float]]:
        marks, self.marks = self.marks, []
        return marks


class Traffic:
    """``streams`` requests in flight without pause: each stream sends the next as soon as
    its last one returns. Counts the requests sent again (a resubmission: counted under the
    update policy in force then) and the completions labelled with more than one version
    (only ``keep`` makes them)."""

    def __init__(self, gen: Any, prompts: list[list[int]], streams: int, max_tokens: int) -> None:
        self.gen, self.prompts, self.streams, self.max_tokens = gen, prompts, streams, max_tokens
        self.policy = "wait"
        self.sent: set[str] = set()
        self.resubmitted: collections.Counter[str] = collections.Counter()
        self.crossed = 0
        self.done = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        #: Cleared: the streams send nothing new (``--lora-rank``: the other server's turn).
        self.active = threading.Event()
        self.active.set()
        engine = gen.engine
        send = engine.send

        async def counted(r: Any, request: Any, version: int) -> Any:
            if request.request_id in self.sent:
                self.resubmitted[self.policy] += 1
            self.sent.add(request.request_id)
            return await send(r, request, version)

        engine.send = counted
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        from forgerl.types import GenerationRequest, SamplingParams

        async def stream(i: int) -> None:
            k = 0
            while not self.stop.is_set():
                if not self.active.is_set():
                    await asyncio.sleep(0.05)
                    continue
                prompt = self.prompts[(i + k * self.streams) % len(self.prompts)]
                request = GenerationRequest(
                    f"s{i}-{k}", prompt, 1, SamplingParams(max_tokens=self.max_tokens, temperature=1.0)
                )
                (comp,) = (await self.gen.generate([request]))[0]
                self.crossed += comp.versions is not None
                self.done += 1
                k += 1

        try:
            await asyncio.gather(*(stream(i) for i in range(self.streams)))
        except BaseException as exc:  # noqa: BLE001 - reported by main
            self.errors.append(exc)


def exported(model: Any, lora: bool) -> dict[str, Any]:
    """What the trainer sends: the whole state dict, or (LoRA) the adapter's A and B under
    PEFT's file names, as the fsdp trainer's ``export_weights`` gives them."""
    if not lora:
        return model.state_dict()
    from forgerl_plugins.trainers.shared.lora import exported_names

    return exported_names({n: p.detach() for n, p in model.named_parameters() if p.requires_grad})


def one_update(
    gen: Any, sender: Any, model: Any, version: int, order: str, timed: Timed, lora: bool = False
) -> dict[str, Any]:
    import torch

    from forgerl.types import WeightSet

    with torch.no_grad():  # a real change, so that the final check means something
        for p in model.parameters():
            if p.requires_grad:  # all of them, or the adapter's alone
                p.add_(torch.randn_like(p) * 1e-3)
    errors: list[BaseException] = []
    started: dict[str, float] = {}

    def load() -> None:
        started["update"] = time.perf_counter()
        try:
            gen.update_weights(version)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def send() -> float:
        start = time.perf_counter()
        state = exported(model, lora)
        export = time.perf_counter() - start
        sender.send(WeightSet(version, state))
        return export

    timed.take()
    loader = threading.Thread(target=load)
    if order == "staged":
        export = send()
        loader.start()
    else:
        loader.start()
        export = send()
    loader.join()
    if errors:
        raise errors[0]
    marks = timed.take()
    pause = next(m for m in marks if m[0] == "pause")
    resume = [m for m in marks if m[0] == "resume"][-1]
    counts = sum(end - start for name, start, end in marks if name == "sampled_so_far")
    load_call = sum(end - start for name, start, end in marks if name == "load")
    stage = sum(end - start for name, start, end in marks if name == "stage")
    workers = [w for loads in gen.updater.last_update["workers"].values() for w in loads]
    stall = resume[2] - pause[1]
    worker = max(w["seconds"] for w in workers)
    return {
        "mode": "lora" if lora else "full",
        "version": version,
        "order": order,
        "staging": ("prepack" if gen.engine.prepack_updates else "on") if gen.engine.stage_updates and not lora
        else "off",
        # Packing ahead: built before the pause (in the stage), swapped in under it.
        "prepacked": all(w.get("prepacked", False) for w in workers),
        "prepack_fallback": sorted({str(w["prepack_fallback"]) for w in workers if w.get("prepack_fallback")}),
        "prepack_s": max(w.get("prepack_seconds", 0.0) for w in workers),
        "swap_s": max(w.get("swap_seconds", 0.0) for w in workers),
        "bytes": max(w.get("bytes", 0) for w in workers),
        "stage_s": stage,
        "drain_s": pause[1] - started["update"],
        "stall_s": stall,
        "counts_s": counts,
        "worker_s": worker,
        "worker_wait_s": max(w.get("wait_seconds", 0.0) for w in workers),
        "worker_read_s": max(w.get("read_seconds", 0.0) for w in workers),
        "worker_load_s": max(w.get("load_seconds", 0.0) for w in workers),
        "rest_s": stall - counts - worker,
        # The rest's parts: the pause call (it returns once the engine's step in progress
        # ended), the load RPC's own overhead (HTTP, JSON, the engine's turn to run it),
        # and the resume (prefix-cache reset, under keep preempting the frozen requests, then resume).
        "pause_call_s": pause[2] - pause[1],
        "load_rpc_s": load_call - worker,
        "resume_call_s": resume[2] - resume[1],
        "export_s": export,
        "send_s": sender.last_send_seconds,
    }


def wait_in_flight(gen: Any, streams: int, settle: float) -> None:
    """Until every stream has a request on the replica, then ``settle`` s more so that
    they are decoding (not just admitted) when the update comes."""
    deadline = time.monotonic() + 120
    while sum(info["outstanding"] for info in gen.replica_info()) < streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the traffic never filled the replica")
        time.sleep(0.02)
    time.sleep(settle)


def wait_idle(gen: Any) -> None:
    """Until nothing of ours is in flight on ``gen``'s replicas (its streams stopped)."""
    deadline = time.monotonic() + 300
    while sum(info["outstanding"] for info in gen.replica_info()) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the other server's requests never finished")
        time.sleep(0.02)


class Side:
    """One server with its generator, sender, traffic and the trainer's model (``full``:
    the whole model; ``lora``: the same with a PEFT adapter, only A and B trainable)."""

    def __init__(self, mode: str, gen: Any, sender: Any, model: Any, prompts: list[list[int]], args: Any) -> None:
        self.mode, self.gen, self.sender, self.model = mode, gen, sender, model
        self.lora = mode == "lora"
        self.timed = Timed(gen.engine)
        self.traffic = Traffic(gen, prompts, args.streams, args.max_tokens)
        self.version = 0


def main() -> None:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3, help="updates per policy and order")
    parser.add_argument("--order", choices=("concurrent", "staged", "both"), default="both")
    parser.add_argument("--staging", choices=("on", "off", "both"), default="both")
    parser.add_argument("--prepack", choices=("on", "off", "both"), default="on",
                        help="with staging: build the packed layers before the pause too (prepack_updates)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of wait,abort,keep")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of decoding before each update")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also a LoRA adapter of this rank (its own server), taking turns with full weights")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], help="more config, e.g. transport.timeout=300")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    sets = ["generator.options.kv_cache_gb=1", *args.set]
    configs = {"full": resolved_config(args.model, sets, "shm")}
    if args.lora_rank:
        configs["lora"] = resolved_config(args.model, [*sets, f"trainer.options.lora.rank={args.lora_rank}"], "shm")
    model_dir = model_folder(configs["full"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompts_for(configs["full"], model_dir, 16)
    orders = ["concurrent", "staged"] if args.order == "both" else [args.order]
    staged = {"on": ["prepack"], "off": ["on"], "both": ["on", "prepack"]}[args.prepack]
    stagings = {"on": staged, "off": ["off"], "both": ["off", *staged]}[args.staging]
    policies = [p for p in args.policies.split(",") if p]
    if not set(policies) <= set(POLICIES):
        parser.error(f"--policies: each of {', '.join(POLICIES)}")
    updates: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    gaps: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        sides: list[Side] = []
        for mode, config in configs.items():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            if mode == "lora":  # the adapter the config's trainer trains (B = 0: version 0 is the base model)
                from forgerl.adapters import LoraOptions
                from forgerl_plugins.trainers.shared.lora import apply_lora

                model, _ = apply_lora(model, LoraOptions(rank=args.lora_rank))
                model.eval()
            gen, sender = stack.enter_context(plugin_servers(config, Path(tmp) / mode, model_dir))
            sides.append(Side(mode, gen, sender, model, prompts, args))
        for side in sides:
            side.traffic.active.clear()
            side.traffic.thread.start()
        current: Side | None = None

        def turn(side: Side) -> None:
            """``side``'s traffic alone, decoding, before its update."""
            nonlocal current
            if current is not side:
                for other in sides:
                    if other is not side:
                        other.traffic.active.clear()
                side.traffic.active.set()
                for other in sides:
                    if other is not side:
                        wait_idle(other.gen)
                current = side
            wait_in_flight(side.gen, args.streams, args.settle)

        try:
            for side in sides:
                # Not measured: the worker builds its transport receiver on its first update.
                turn(side)
                side.version = 1
                one_update(side.gen, side.sender, side.model, 1, "staged", side.timed, side.lora)
            for _ in range(args.rounds):
                for order in orders:
                    for policy in policies:
                        for staging in stagings:
                            for side in sides:
                                side.version += 1
                                # After the last update's resubmissions went out (counted under its policy).
                                turn(side)
                                side.gen.updater.policy = side.traffic.policy = policy
                                side.gen.engine.stage_updates = staging != "off"
                                side.gen.engine.prepack_updates = staging == "prepack"
                                result = one_update(side.gen, side.sender, side.model, side.version, order,
                                                    side.timed, side.lora)  # fmt: skip
                                updates.append({"policy": policy, **result})
                                if side.traffic.errors:
                                    raise side.traffic.errors[0]
            for side in sides:
                side.gen.updater.policy = side.traffic.policy = "wait"
        finally:
            for side in sides:
                side.traffic.stop.set()
                side.traffic.active.set()
            for side in sides:
                side.traffic.thread.join(300)
        for side in sides:
            gaps[side.mode] = check_logprobs(side.gen, side.model, tokenizer)
    load_after = os.getloadavg()
    modes = list(configs)
    keys = ("stage_s", "drain_s", "stall_s", "counts_s", "worker_wait_s", "worker_read_s", "worker_load_s", "rest_s",
            "pause_call_s", "load_rpc_s", "resume_call_s", "export_s", "send_s", "prepack_s", "swap_s")  # fmt: skip
    groups = {
        f"{mode}/{policy}/{order}/{staging}": [
            u for u in updates
            if (u["mode"], u["policy"], u["order"], u["staging"]) == (mode, policy, order, staging if mode == "full" else "off")
        ]
        for order in orders
        for policy in policies
        for staging in stagings
        for mode in modes
    }  # fmt: skip
    summary = {
        name: {
            **{key: statistics.median(u[key] for u in group) for key in keys},
            "max_stall_s": max(u["stall_s"] for u in group),
            "min_stall_s": min(u["stall_s"] for u in group),
            "updates": len(group),
            "mib": max(u["bytes"] for u in group) / 2**20,
            "prepacked": sum(u["prepacked"] for u in group),
            "prepack_fallbacks": sorted({f for u in group for f in u["prepack_fallback"]}),
        }
        for name, group in groups.items()
        if group
    }
    resubmitted = {f"{side.mode}/{p}": side.traffic.resubmitted[p] for side in sides for p in policies}
    result = {
        "model": args.model,
        "lora_rank": args.lora_rank,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "updates": updates,
        "median": summary,
        "resubmitted": resubmitted,
        "crossed": {side.mode: side.traffic.crossed for side in sides},
        "completions": {side.mode: side.traffic.done for side in sides},
        "logprob_gap_after_updates": gaps,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.model}, shm, {args.streams} requests in flight (max_tokens {args.max_tokens}); "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(
        "mode/policy/order/staging     MiB   stage   drain   stall (min, max)      counts  w.wait  w.read  w.load"
        "  rest (pause, rpc, resume)       export  send  prepack  swap"
    )
    for name, m in summary.items():
        print(
            f"{name:29s} {m['mib']:6.1f} {m['stage_s']:5.2f}  {m['drain_s']:6.2f}  {m['stall_s']:5.2f} "
            f"({m['min_stall_s']:5.2f}, {m['max_stall_s']:5.2f})  {m['counts_s']:6.2f}"
            f"  {m['worker_wait_s']:6.2f}  {m['worker_read_s']:6.2f}  {m['worker_load_s']:6.2f}  {m['rest_s']:6.2f}"
            f" ({m['pause_call_s']:5.3f}, {m['load_rpc_s']:5.3f}, {m['resume_call_s']:5.3f})"
            f"  {m['export_s']:6.3f}  {m['send_s']:5.2f}  {m['prepack_s']:6.2f}  {m['swap_s']:5.2f}"
        )
    for name, m in summary.items():
        if m["prepack_fallbacks"]:
            print(f"{name}: not packed ahead ({m['updates'] - m['prepacked']} updates): {m['prepack_fallbacks']}")
    print(f"resubmitted requests: {resubmitted}; completions labelled with two versions: {result['crossed']} "
          f"of {result['completions']}; logprob gap after the updates: {gaps}")  # fmt: skip


if __name__ == "__main__":
    main()
