"""How many cores vLLM's CPU build should get in a synchronous run.

Run: .venv/bin/python benchmarks/vllm_cores.py [--model smollm2-135m-instruct]
     [--prompts 8] [--n 4] [--max-tokens 64] [--repeats 2] [--json]

vLLM's CPU build binds its OpenMP threads itself and, by default, keeps one core per
worker out of the binding for its own scheduler process: on a 2-core machine generation
runs on one core. In a synchronous run (``loop.max_staleness=0``) nothing else runs while
the generator generates, so that core sits idle. This starts the plugin's server (as
``forge run`` does) once per variant, alternating the variants ``--repeats`` times so that
load changes hit both alike, and reports generated tokens per second of each:

* ``reserve-1``: vLLM's own default (``VLLM_CPU_NUM_OF_RESERVED_CPU`` unset);
* ``reserve-0``: every core bound to the worker's threads;
* ``forgerl``: what the plugin chooses by itself for a synchronous run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_servers import model_folder, resolved_config
from vllm_throughput import prompts_for, run_plugin

VARIANTS = {
    "reserve-1": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    "reserve-0": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "forgerl": {},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = args.variants.split(",")

    base = ["generator.options.kv_cache_gb=1.0", "loop.max_staleness=0"]
    model_dir = model_folder(resolved_config(args.model, base))
    prompts = prompts_for(resolved_config(args.model, base), model_dir, args.prompts)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            env = VARIANTS[name]
            sets = [*base, *(f"generator.options.env.{k}={json.dumps(v)}" for k, v in env.items())]
            saved = {k: os.environ.pop(k) for k in env if k in os.environ}
            try:
                rounds = run_plugin(resolved_config(args.model, sets), model_dir, prompts, args.n, args.max_tokens, 2)
            finally:
                os.environ.update(saved)
            rate = max(r["tokens_per_s"] for r in rounds)
            rates[name].append(rate)
            print(f"{name:<10} repeat {repeat + 1}: {rate:7.1f} generated tokens/s "
                  f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)  # fmt: skip
    result = {
        "cpus": os.cpu_count(),
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "tokens_per_s": {n: [round(r, 1) for r in v] for n, v in rates.items()},
        "median": {n: round(statistics.median(v), 1) for n, v in rates.items()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, med in result["median"].items():
            print(f"{name:<10} {med:7.1f} generated tokens/s (median of {args.repeats})")


if __name__ == "__main__":
    main()
