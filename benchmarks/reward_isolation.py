"""What running blocking rewards in worker processes costs, against threads.

    .venv/bin/python benchmarks/reward_isolation.py

Prints, for the built-in ``format`` and ``math_answer`` rewards: the time per
(sample, reward) on threads (reward instances given to RewardSet directly) and in the
worker processes (rewards with a recipe, as a run builds them), the time until a cold pool
answers its first sample, and the time from killing a hung worker to its replacement
being ready. Numbers are medians; compare them within one session, on one machine.
"""

from __future__ import annotations

import statistics
import time

from forgerl.rewards.reward_workers import RewardRecipe
from forgerl.rewards.rewarding import NamedReward, RewardSet
from forgerl.types import Problem, RewardInput
from forgerl_plugins.rewards.format import FormatReward
from forgerl_plugins.rewards.math_answer import MathAnswerReward

BACKTRACKING = "^(.+)+\\x00"
REWARDS = {
    "format": (lambda o: FormatReward(FormatReward.Options(**o)), {}),
    "math_answer": (lambda o: MathAnswerReward(MathAnswerReward.Options(**o)), {}),
}


def samples(n: int) -> list[RewardInput]:
    return [
        RewardInput(Problem(id=f"p{i}", prompt="q", answer="42"), f"17 + 25 = 42 <answer>{40 + i % 5}</answer>")
        for i in range(n)
    ]


def per_sample_us(rs: RewardSet, n: int = 400, repeats: int = 5) -> float:
    rs.score_sync(samples(8))  # warm: workers started, imports done
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rs.score_sync(samples(n))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n * 1e6


def main() -> None:
    for name, (make, options) in REWARDS.items():
        with RewardSet([NamedReward(name, 1.0, make(options))], max_workers=2) as rs:
            threads = per_sample_us(rs)
        start = time.perf_counter()
        with RewardSet([NamedReward(name, 1.0, make(options), RewardRecipe(name, options))], max_workers=2) as rs:
            rs.score_sync(samples(1))
            cold = time.perf_counter() - start
            processes = per_sample_us(rs)
        print(f"{name}: {threads:.0f} us/sample on threads, {processes:.0f} us/sample in 2 worker processes; "
              f"first answer from a cold pool {cold:.2f} s")

        # A hung sample on each worker; the replacement's start is timed by the pool.
        hang = {"pattern": BACKTRACKING}
        bad = NamedReward("format", 1.0, FormatReward(FormatReward.Options(**hang)), RewardRecipe("format", hang))
        rewards = [bad] + ([NamedReward(name, 1.0, make(options), RewardRecipe(name, options))]
                           if name != "format" else [])
        with RewardSet(rewards, timeout=0.5, max_workers=2) as rs:
            for _ in range(3):
                rs.score_sync([RewardInput(Problem(id="p", prompt="q"), "a" * 40)] * 2)
            ready = rs.pool.replacement_seconds
            print(f"  with {name}: kill -> replacement ready median {statistics.median(ready):.2f} s "
                  f"(min {min(ready):.2f}, max {max(ready):.2f}, {len(ready)} replacements)")


if __name__ == "__main__":
    main()
