"""Does the default demo learn? Held-out accuracy before and after a fixed budget.

Runs `forge run` (the default demo: SmolLM2-135M-Instruct on `arithmetic`, local
scheduler, fsdp trainer, the fastest available generator) for --steps steps and reports
held-out accuracy at the start and at the end, the reward curve, the wall time, the
medians of the step's parts (train, weight sync), the bytes each weight update moved,
the logprob gap, and the machine's load average before and after.

    .venv/bin/python benchmarks/learning.py --steps 20 [--output DIR] [--set key=value ...] [--json]
    .venv/bin/python benchmarks/learning.py --environment calculator --steps 40   # multi-turn, tools
    .venv/bin/python benchmarks/learning.py --environment guess --steps 18 --set environment.options.high=8 ...
    .venv/bin/python benchmarks/learning.py --steps 20 --set trainer.options.lora.rank=16 \
        --set trainer.options.lr=1e-4                                         # a LoRA adapter

Extra --set values go to `forge run` unchanged (e.g. `--set trainer.options.lr=5e-6`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default=None)
    parser.add_argument("--generator", default=None)
    parser.add_argument("--environment", default=None, help="run with this environment (multi-turn rollouts)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    out = Path(args.output or f"runs/learning-{time.strftime('%Y%m%d-%H%M%S')}")
    cmd = [sys.executable, "-m", "forgerl.cli", "run", "--steps", str(args.steps), "--output", str(out),
           "--set", "logging.progress=false"]
    if args.generator:
        cmd += ["--generator", args.generator]
    if args.environment:
        cmd += ["--environment", args.environment]
    for s in args.sets:
        cmd += ["--set", s]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    if proc.returncode != 0:
        sys.exit(f"forge run failed with {proc.returncode}; see {out}/logs")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    import yaml

    config = yaml.safe_load((out / "config.yaml").read_text())
    result = {
        "steps": summary["steps"],
        "eval_accuracy_start": summary["eval_accuracy_start"],
        "eval_accuracy_end": summary["eval_accuracy_end"],
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r],
        "reward_first5": sum(r["reward/mean"] for r in rows[:5]) / max(1, len(rows[:5])),
        "reward_last5": sum(r["reward/mean"] for r in rows[-5:]) / max(1, len(rows[-5:])),
        "wall_minutes": round(wall / 60, 1),
        # With an environment: assistant turns per trajectory (above 1: tools were called).
        "turns_first5": _mean(rows[:5], "env/turns_mean"),
        "turns_last5": _mean(rows[-5:], "env/turns_mean"),
        # The reward's components on the training samples (e.g. the guess game's hints and
        # hints followed), first and last 5 steps.
        "components_first5": _components(rows[:5]),
        "components_last5": _components(rows[-5:]),
        "time": summary["time"],
        "train_s_median": _median(rows, "time/train"),
        "sync_s_median": _median(rows, "time/sync"),
        "step_s_median": _median(rows, "time/step"),
        "bytes_per_update": _median(rows, "sync/bytes"),
        "logprob_gap_mean_max": max((r["logprob_gap/mean"] for r in rows if r.get("logprob_gap/mean") is not None),
                                    default=None),
        # 1, 5 and 15 minute load averages when the run began and ended: a shared machine's
        # times are only comparable at similar loads.
        "load_before": [round(x, 1) for x in load_before],
        "load_after": [round(x, 1) for x in load_after],
        "run_dir": str(out),
        "generator": config["generator"]["name"],
        "model": config["model"]["name"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"held-out accuracy: {result['eval_accuracy_start']:.3f} -> {result['eval_accuracy_end']:.3f} "
          f"after {result['steps']} steps ({result['wall_minutes']} min)")
    print(f"mean reward, first 5 steps: {result['reward_first5']:.3f}; last 5 steps: {result['reward_last5']:.3f}")
    print(f"eval curve: {result['eval_curve']}")
    if result["bytes_per_update"] is not None:
        print(f"per update: {result['bytes_per_update'] / 2**20:.1f} MiB moved; median train {result['train_s_median']:.1f} s, "
              f"sync {result['sync_s_median']:.2f} s, step {result['step_s_median']:.1f} s")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if result["turns_first5"] is not None:
        print(f"assistant turns per trajectory, first 5 steps: {result['turns_first5']:.2f}; "
              f"last 5 steps: {result['turns_last5']:.2f}")
    for name, first in result["components_first5"].items():
        print(f"reward component {name}, first 5 steps: {first:.3f}; last 5 steps: "
              f"{result['components_last5'].get(name, float('nan')):.3f}")


def _components(rows: list[dict]) -> dict[str, float]:
    names = sorted({k for r in rows for k in r if k.startswith("reward/") and k not in ("reward/mean", "reward/failed")})
    return {n.removeprefix("reward/"): _mean(rows, n) for n in names}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


if __name__ == "__main__":
    main()
