"""Trajectories per minute against ``environment.concurrency``, on the hf generator.

Runs N three-turn trajectories of a small environment (each step answers with a user
message; the last ends the trajectory) through the in-process hf generator, with the
trajectories in flight capped at 1 and at C, and prints trajectories per minute, the mean
generator batch, and the share of wall time the generator was busy. With the tiny model
(default) it measures the machinery; ``--model DIR`` takes any local folder.

    python benchmarks/environment_concurrency.py [--model DIR] [--n 32] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from forgerl.config import RunConfig
    from forgerl.environment import Environment, Step
    from forgerl.interfaces import RunContext
    from forgerl.trajectory import Limits, TrajectoryRunner
    from forgerl.types import Problem, SamplingParams
    from forgerl_plugins.generators.hf.generator import HFGenerator
    from forgerl_plugins.models.tiny import TinyModel, build_tiny_model
    from forgerl_plugins.transports.shm.transport import ShmTransport

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    model = args.model or build_tiny_model(TinyModel.Options(), cache_dir=tmp)

    class Chatty(Environment):
        def __init__(self) -> None:
            self.turns = 0

        def reset(self, problem):
            return [{"role": "user", "content": str(problem.prompt)}]

        def step(self, text):
            self.turns += 1
            return Step.finish(0.0) if self.turns == 3 else Step.observe({"role": "user", "content": "Go on."})

    class Timed(HFGenerator):
        busy = 0.0

        async def generate(self, requests):
            t = time.perf_counter()
            try:
                return await super().generate(requests)
            finally:
                Timed.busy += time.perf_counter() - t

    transport = ShmTransport(ShmTransport.Options(directory=str(tmp / "shm")), context=None)
    gen = Timed(HFGenerator.Options(batch_size=64), context=RunContext.for_run(RunConfig(), tmp, model_path=model), transport=transport)
    tokenizer = AutoTokenizer.from_pretrained(model)
    jobs = [(Problem(f"p{i}", f"What is {i} + {i}?"), f"r{i}", i) for i in range(args.n)]
    try:
        for concurrency in args.concurrency:
            limits = Limits(max_turns=3, max_total_tokens=1024, max_turn_tokens=args.turn_tokens,
                            turn_timeout=30.0, concurrency=concurrency)
            runner = TrajectoryRunner(Chatty, Chatty, tokenizer, limits, SamplingParams(max_tokens=args.turn_tokens))
            Timed.busy = 0.0
            t = time.perf_counter()
            trajectories, batcher = asyncio.run(runner.run_many(gen, jobs))
            wall = time.perf_counter() - t
            sampled = sum(sum(x.completion.mask or ()) for x in trajectories)
            print(f"concurrency {concurrency:>3}: {args.n / wall * 60:7.1f} trajectories/min, "
                  f"{sampled / wall:7.1f} sampled tokens/s, mean generator batch "
                  f"{batcher.requests / max(batcher.batches, 1):5.1f}, generator busy {Timed.busy / wall:5.1%}")
    finally:
        gen.close()
        transport.close()


if __name__ == "__main__":
    main()
