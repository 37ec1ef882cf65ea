"""Does the default demo learn? Held-out accuracy before and after a fixed budget.

Runs `forge run` (the default demo: SmolLM2-135M-Instruct on `arithmetic`, local
scheduler, fsdp trainer, the fastest available generator) for --steps steps and reports
held-out accuracy at the start and at the end, the reward curve and the wall time.

    .venv/bin/python benchmarks/learning.py --steps 20 [--output DIR] [--set key=value ...] [--json]
    .venv/bin/python benchmarks/learning.py --environment calculator --steps 40   # multi-turn, tools
    .venv/bin/python benchmarks/learning.py --environment guess --steps 18 --set environment.options.high=8 ...

Extra --set values go to `forge run` unchanged (e.g. `--set trainer.options.lr=5e-6`).
"""

from __future__ import annotations

import argparse
import json
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
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
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
    if result["turns_first5"] is not None:
        print(f"assistant turns per trajectory, first 5 steps: {result['turns_first5']:.2f}; "
              f"last 5 steps: {result['turns_last5']:.2f}")
    for name, first in result["components_first5"].items():
        print(f"reward component {name}, first 5 steps: {first:.3f}; last 5 steps: "
              f"{result['components_last5'].get(name, float('nan')):.3f}")


def _components(rows: list[dict]) -> dict[str, float]:
    names = sorted({k for r in rows for k in r if k.startswith("reward/") and k not in ("reward/mean", "reward/failed")})
    return {n.removeprefix("reward/"): _mean(rows, n) for n in names}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


if __name__ == "__main__":
    main()
