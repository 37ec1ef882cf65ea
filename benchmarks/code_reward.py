"""Programs the `code` reward scores per second: passing programs and programs that time out.

Run: .venv/bin/python benchmarks/code_reward.py [--samples N] [--isolation auto] [--python P] [--json]

Each sample is one MBPP-style problem (two asserts) and one completion, scored through
the reward as a run scores it (`CodeReward.score`, the sandbox's process per program), from
`--threads` threads at once (a run's reward worker processes do the same; the reward's
`concurrency` option, default the usable cores, bounds the programs in flight). Reported:
samples per second and the median latency of one sample, for a passing program, a failing
one, and one that loops until the wall-clock `--timeout` kills it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput

PROBLEM = Problem(
    id="add",
    prompt="Write add(a, b).",
    metadata={"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
)
PROGRAMS = {
    "passing": "```python\ndef add(a, b):\n    return a + b\n```",
    "failing": "```python\ndef add(a, b):\n    return a - b\n```",
    "timing out": "```python\nwhile True:\n    pass\n```",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0, help="default: the reward's concurrency")
    parser.add_argument("--isolation", default="auto")
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--python", default=None, help="interpreter of the programs (process level as root)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reward = (
        build_registry()
        .require("reward", "code")
        .build({"isolation": args.isolation, "timeout": args.timeout, "python": args.python})
    )
    threads = args.threads or reward.sandbox.concurrency
    results = {
        "isolation": reward.sandbox.level,
        "concurrency": reward.sandbox.concurrency,
        "threads": threads,
    }
    for label, program in PROGRAMS.items():
        n = args.samples if label != "timing out" else max(threads, args.samples // 8)
        sample = RewardInput(PROBLEM, program)

        def one(_: int, sample: RewardInput = sample) -> float:
            t = time.perf_counter()
            reward.score(sample)
            return time.perf_counter() - t

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            latencies = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - start
        results[label] = {
            "samples": n,
            "per_second": n / elapsed,
            "median_latency_s": statistics.median(latencies),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"isolation {results['isolation']}, concurrency {results['concurrency']}, {threads} threads")
    for label in PROGRAMS:
        r = results[label]
        print(
            f"{label:12s} {r['samples']:4d} samples  {r['per_second']:6.2f}/s  median {r['median_latency_s']:.3f} s"
        )


if __name__ == "__main__":
    main()
