"""Trajectories per minute against ``environment.concurrency``, and the generator's idle time.

Runs N trajectories of a small environment (``--turns`` assistant turns of ``--turn-tokens``
tokens each; each step answers with a user message, the last ends the trajectory) with the
trajectories in flight capped at each ``--concurrency`` C, and prints trajectories per
minute, sampled tokens per second, the mean generator batch, the share of wall time the
generator had at least one request (``busy``), the mean number of requests it had
(``in flight``), how long a turn's request waited before it was sent (``queue``), and the
CPU seconds per trajectory of the client (this process: environments, chat templates,
HTTP) and of the vllm server's processes: less sensitive than wall time to other work on
shared cores.

``--modes single`` adds, for each C, N single-turn samples of the same total length (one
request of ``turns x turn-tokens`` tokens each from the same first prompt, C in flight, each
sent the moment a slot frees): what the generator does with the same tokens and no
environment in between.

* ``--generator hf`` (default): the in-process hf generator, one torch thread, on the tiny
  model (``--model DIR`` takes any local folder). Busy = inside ``generate``.
* ``--generator vllm``: one vLLM server started by the plugin's role (what ``forge run``
  starts), on the default model (``--model NAME``), driven through ``VLLMGenerator`` over
  HTTP. Busy = at least one HTTP request in flight. Every turn samples exactly
  ``--turn-tokens`` tokens (``ignore_eos``), so both sides generate the same tokens.

``--modes batched continuous``: the turn requests of the trajectories gathered while a
batch is generated (what every generator gets in a run: ``RequestBatcher``) or, to see
what that costs a server that batches continuously, each sent the moment it is ready
(the benchmark's own variant); ``--lengths natural``
lets vLLM's turns end at the model's eos, so turn lengths vary as in a run.

    python benchmarks/environment_concurrency.py [--generator hf|vllm] [--model M] [--n 32]
        [--turns 3] [--turn-tokens 16] [--concurrency 1 4 16] [--modes batched continuous single]
        [--repeats 1] [--lengths fixed natural]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Meter:
    """Requests in flight at the generator over time (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.inflight = 0
            self.last = time.perf_counter()
            self.busy = 0.0  # seconds with >= 1 request in flight
            self.area = 0.0  # integral of requests in flight over time
            self.ready: dict[str, float] = {}  # request id -> when its trajectory asked for it
            self.queued = 0.0  # summed seconds between asking and sending
            self.sent = 0
            self.cpu = cpu_seconds()

    def change(self, ids: list[str], delta: int) -> None:
        with self._lock:
            now = time.perf_counter()
            dt = now - self.last
            if self.inflight > 0:
                self.busy += dt
            self.area += self.inflight * dt
            self.inflight += delta * len(ids)
            self.last = now
            if delta > 0:
                for i in ids:
                    asked = self.ready.pop(i, None)
                    if asked is not None:
                        self.queued += now - asked
                        self.sent += 1

    def asked(self, request_id: str) -> None:
        with self._lock:
            self.ready[request_id] = time.perf_counter()


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of this process (the client: environments, templates, HTTP) and of
    its children (a vllm server and its engine processes). Less sensitive than wall time to
    other work on shared cores."""
    import psutil

    me = psutil.Process()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.Error:
            pass
    t = me.cpu_times()
    return t.user + t.system, children


METER = Meter()
LENGTHS = {"natural": False}  # vllm: whether eos ends a turn (set per row)


def instrument_batcher() -> None:
    """Every trajectory's turn request is timed from the moment it is asked for."""
    from forgerl.rollouts import trajectory

    base = trajectory.RequestBatcher

    class Timed(base):  # type: ignore[misc, valid-type]
        async def generate(self, request):
            METER.asked(request.request_id)
            return await super().generate(request)

    trajectory.RequestBatcher = Timed  # run_concurrently builds it by this name


CONTINUOUS = {"on": False}  # mode continuous: each turn request goes to the generator at once


def continuous_batcher() -> None:
    from forgerl.rollouts import trajectory

    base = trajectory.RequestBatcher

    class Direct(base):  # type: ignore[misc, valid-type]
        async def generate(self, request):
            if not CONTINUOUS["on"]:
                return await super().generate(request)
            METER.asked(request.request_id)
            self.batches += 1
            self.requests += 1
            return (await self.generator.generate([request]))[0][0]

    trajectory.RequestBatcher = Direct


@contextlib.contextmanager
def hf_generator(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Any, Path]]:
    import torch

    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext
    from forgerl_plugins.generators.hf.generator import HFGenerator
    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model
    from forgerl_plugins.transports.shm.transport import ShmTransport

    torch.set_num_threads(1)
    model = Path(args.model) if args.model else build_tiny_model(TinyModel.Options(), cache_dir=tmp)

    class Timed(HFGenerator):
        async def generate(self, requests):
            ids = [r.request_id for r in requests]
            METER.change(ids, +1)
            try:
                return await super().generate(requests)
            finally:
                METER.change(ids, -1)

    transport = ShmTransport(ShmTransport.Options(directory=str(tmp / "shm")), context=None)
    context = RunContext.for_run(RunConfig(), tmp, model_path=model)
    gen = Timed(HFGenerator.Options(batch_size=64), context=context, transport=transport)
    try:
        yield gen, model
    finally:
        gen.close()
        transport.close()


@contextlib.contextmanager
def vllm_generator(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Any, Path]]:
    from _vllm_servers import model_folder, plugin_servers, resolved_config

    from forgerl_plugins.generators.vllm import engine

    body = engine.request_body  # fixed turn lengths: both sides of a comparison sample exactly max_tokens
    engine.request_body = lambda *a, **k: {**body(*a, **k), "ignore_eos": not LENGTHS["natural"]}
    config = resolved_config(args.model or "smollm2-135m-instruct", args.set)
    model = model_folder(config)
    with plugin_servers(config, tmp / "run", model) as (gen, _):
        one = gen._one

        async def timed_one(request):
            METER.change([request.request_id], +1)
            try:
                return await one(request)
            finally:
                METER.change([request.request_id], -1)

        gen._one = timed_one  # generate() maps it over the requests, one HTTP request each
        yield gen, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generator", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model", help="hf: a local folder (default: the tiny model); vllm: a model name")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", choices=["batched", "continuous", "single"], default=["batched"],
                        help="trajectories with turn requests gathered while a batch is generated (batched), "
                        "sent as they come (continuous: a variant of this benchmark), "
                        "and single-turn samples of the same total length (single); alternated")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every mode at every concurrency")
    parser.add_argument("--lengths", nargs="+", choices=["fixed", "natural"], default=["fixed"],
                        help="vllm: every turn samples --turn-tokens (fixed), or eos ends it (natural: lengths vary)")
    parser.add_argument("--set", action="append", default=[], help="vllm: more config, e.g. generator.options.kv_cache_gb=2")
    args = parser.parse_args()
    instrument_batcher()
    continuous_batcher()
    tmp = Path(tempfile.mkdtemp())
    make = vllm_generator if args.generator == "vllm" else hf_generator
    with make(args, tmp) as (gen, model):
        run_rows(args, gen, model)


def run_rows(args: argparse.Namespace, gen: Any, model: Path) -> None:
    from transformers import AutoTokenizer

    from forgerl.environment import Environment, Step
    from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
    from forgerl.types import Problem, SamplingParams

    turns = args.turns

    class Chatty(Environment):
        def __init__(self) -> None:
            self.turns = 0

        def reset(self, problem):
            return [{"role": "user", "content": str(problem.prompt)}]

        def step(self, text):
            self.turns += 1
            return Step.finish(0.0) if self.turns == turns else Step.observe({"role": "user", "content": "Go on."})

    tokenizer = AutoTokenizer.from_pretrained(model)
    jobs = [(Problem(f"p{i}", f"What is {i} + {i}?"), f"r{i}", i) for i in range(args.n)]
    sampling = SamplingParams(max_tokens=args.turn_tokens)
    # Warm-up: one trajectory (first requests, the template's first renderings).
    warm = TrajectoryRunner(Chatty, Chatty, tokenizer, Limits(turns, 4096, args.turn_tokens, 60.0, 1), sampling)
    asyncio.run(warm.run_many(gen, jobs[:1]))
    print(f"{args.generator}, {model.name}: {args.n} trajectories of {turns} turns x {args.turn_tokens} tokens")
    for _ in range(args.repeats):
        for lengths, concurrency in itertools.product(args.lengths, args.concurrency):
            LENGTHS["natural"] = lengths == "natural"
            if args.generator == "vllm":
                print(f"-- {lengths} lengths")
            limits = Limits(max_turns=turns, max_total_tokens=4096, max_turn_tokens=args.turn_tokens,
                            turn_timeout=60.0, concurrency=concurrency)
            runner = TrajectoryRunner(Chatty, Chatty, tokenizer, limits, sampling)
            for mode in args.modes:
                METER.reset()
                t = time.perf_counter()
                if mode == "single":
                    prompts = [runner.chat.prompt_ids(Chatty().reset(p)) for p, _, _ in jobs]
                    one_sampling = SamplingParams(max_tokens=turns * args.turn_tokens)
                    done = asyncio.run(single_turn(gen, prompts, one_sampling, concurrency, args.generator == "hf"))
                    wall = time.perf_counter() - t
                    report(f"single-turn, C={concurrency:<3}", args.n, wall, sum(len(c.token_ids) for c in done), 1.0, 0)
                    continue
                CONTINUOUS["on"] = mode == "continuous"
                trajectories, batcher = asyncio.run(runner.run_many(gen, jobs))
                wall = time.perf_counter() - t
                sampled = sum(sum(x.completion.mask or ()) for x in trajectories)
                failed = sum(x.failure is not None for x in trajectories)
                report(f"{mode:<11s} C={concurrency:<3}", args.n, wall, sampled,
                       batcher.requests / max(batcher.batches, 1), failed)


async def single_turn(gen: Any, prompts: list[list[int]], sampling: Any, concurrency: int, chunks: bool) -> list[Any]:
    """Each prompt once, ``concurrency`` requests in flight: sent as a slot frees (a server
    batches continuously), or with ``chunks`` as one ``generate`` call per ``concurrency``
    prompts (the in-process generator decodes one call's requests together)."""
    from dataclasses import replace

    from forgerl.types import GenerationRequest

    if chunks:
        requests = [GenerationRequest(f"s{i}", ids, 1, replace(sampling, seed=i)) for i, ids in enumerate(prompts)]
        out = []
        for at in range(0, len(requests), concurrency):
            out += [cs[0] for cs in await gen.generate(requests[at : at + concurrency])]
        return out
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> Any:
        async with gate:
            request = GenerationRequest(f"s{i}", ids, 1, replace(sampling, seed=i))
            return (await gen.generate([request]))[0][0]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def report(what: str, n: int, wall: float, sampled: int, batch: float, failed: int) -> None:
    m = METER
    m.change([], 0)  # close the last interval
    queue = f"{m.queued / max(m.sent, 1) * 1000:6.0f} ms" if m.sent else "      -  "
    (me0, kids0), (me1, kids1) = m.cpu, cpu_seconds()
    cpu = f", CPU s per item: client {(me1 - me0) / n:5.2f}" + (f" server {(kids1 - kids0) / n:5.2f}" if kids1 else "")
    print(f"{what}: {n / wall * 60:7.1f} per min, {sampled / n:5.1f} sampled tokens each, {sampled / wall:7.1f}/s, "
          f"batch {batch:5.1f}, busy {m.busy / wall:5.1%}, in flight {m.area / wall:5.1f}, "
          f"queue {queue}, wall {wall:6.1f} s{cpu}" + (f", {failed} FAILED" if failed else ""))


if __name__ == "__main__":
    main()
