"""Does a model learn to use a tool? Base model, RL alone, SFT alone and SFT then RL.

The `calculator` environment on problems a 135M model cannot do in its head (the
`arithmetic` task's 3-digit times 3-digit products by default; its fixed held-out split of
64), in four runs of the same model:

- **rl**: `forge run --environment calculator` from the base model; its evaluation before
  the first step is the **base** model's;
- **sft**: `forge sft` on tool-using demonstrations made by scripts/calculator_demos.py
  (training problems only, no model involved), evaluated through the environment;
- **sft+rl**: `forge run --model <the sft run>`, the same RL as the first run.

Reported per stage: held-out accuracy, tool-call rate on the held-out problems
(`eval/reward/used_tool`), answers in the tag, and wall time; then the goal: SFT + RL at
least 50 points over the base model and over RL alone, a tool-call rate of at least 0.9,
the pipeline (demonstrations, SFT, RL) within 30 minutes; and what RL added to SFT alone.

    .venv/bin/python benchmarks/tool_use.py                  # the measurement (vLLM, SmolLM2-135M)
    .venv/bin/python benchmarks/tool_use.py --smoke          # tiny model, hf generator, minutes

`--smoke` runs every stage end to end on the tiny random model: it shows the script works,
not that anything learns. Extra `--set key=value` go to every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _forge_cli import check, forge  # benchmarks/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
TASK = ["--task", "arithmetic", "--environment", "calculator",
        "--set", "task.options.min_value=100", "--set", "task.options.max_value=999",
        "--set", "task.options.operations=['*']"]  # fmt: skip
SMOKE = ["--generator", "hf", "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2",
         "--set", "loop.sampling.max_tokens=16", "--set", "loop.eval_size=4",
         "--set", "environment.max_total_tokens=96", "--set", "trainer.options.autocast_bf16=false"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--generator", default="vllm")
    parser.add_argument("--demos", type=int, default=300, help="tool-using demonstrations for SFT")
    parser.add_argument("--sft-steps", type=int, default=40, help="SFT steps (sft.batch_size demonstrations each)")
    parser.add_argument("--sft-lr", type=float, default=3e-5, help="the SFT run's learning rate (RL keeps the trainer's)")
    parser.add_argument("--rl-steps", type=int, default=20, help="RL steps of the SFT+RL run")
    parser.add_argument("--rl-alone-steps", type=int, default=None,
                        help="RL steps of the RL-alone run (default: --rl-steps); a base model that never "
                             "calls the tool earns reward 0 on every sample, so RL alone has no signal to follow")  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="folder of every run (default runs/tool-use-<time>)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more --set for every run")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, end to end, in minutes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = args.output or REPO / "runs" / time.strftime("tool-use-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        common, model = [*TASK, *SMOKE], "tiny"
        args.demos, args.sft_steps, args.rl_steps = min(args.demos, 16), min(args.sft_steps, 2), min(args.rl_steps, 2)
    else:
        common, model = [*TASK, "--generator", args.generator], args.model
    for s in args.sets:
        common += ["--set", s]

    demos = out / "calculator-demos.jsonl"
    start = time.perf_counter()
    check([sys.executable, str(REPO / "scripts" / "calculator_demos.py"), "--count", str(args.demos),
            "--output", str(demos)], "scripts/calculator_demos.py")  # fmt: skip
    demos_s = time.perf_counter() - start

    # SFT first: its stages answer the question, and the RL-alone run (long, and with no
    # reward signal when the base model never calls the tool) comes last.
    sft = _forge(out / "sft", ["sft", *common, "--model", model, "--data", str(demos), "--steps", str(args.sft_steps),
                               "--set", f"trainer.options.lr={args.sft_lr}", "--set", "loop.eval_at_start=false"])  # fmt: skip
    sft_rl = _forge(out / "sft-rl", ["run", *common, "--model", str(out / "sft"), "--steps", str(args.rl_steps),
                                     "--set", "loop.eval_at_start=false"])  # fmt: skip
    rl_alone_steps = args.rl_steps if args.rl_alone_steps is None else args.rl_alone_steps
    rl = _forge(out / "rl", ["run", *common, "--model", model, "--steps", str(rl_alone_steps)])
    stages = [
        {"stage": "base", **rl["start"], "wall_s": None},
        {"stage": "rl", **rl["end"], "wall_s": rl["wall_s"]},
        {"stage": "sft", **sft["end"], "wall_s": sft["wall_s"]},
        {"stage": "sft+rl", **sft_rl["end"], "wall_s": sft_rl["wall_s"]},
    ]
    report = {"model": model, "demos": args.demos, "demos_s": round(demos_s, 1),
              "sft_steps": args.sft_steps, "sft_lr": args.sft_lr, "rl_steps": args.rl_steps,
              "rl_alone_steps": rl_alone_steps, "stages": stages,
              "verdict": verdict(stages, demos_s), "dir": str(out)}  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else render(report))


def verdict(stages: list[dict[str, Any]], demos_s: float) -> dict[str, Any]:
    by = {s["stage"]: s for s in stages}
    pipeline_s = None
    if by["sft"]["wall_s"] is not None and by["sft+rl"]["wall_s"] is not None:
        pipeline_s = round(demos_s + by["sft"]["wall_s"] + by["sft+rl"]["wall_s"], 1)
    gain_base = by["sft+rl"]["accuracy"] - by["base"]["accuracy"]
    gain_rl = by["sft+rl"]["accuracy"] - by["rl"]["accuracy"]
    return {
        "gain_over_base_pts": round(100 * gain_base, 1),
        "gain_over_rl_pts": round(100 * gain_rl, 1),
        "rl_after_sft_adds_pts": round(100 * (by["sft+rl"]["accuracy"] - by["sft"]["accuracy"]), 1),
        "tool_call_rate": by["sft+rl"]["tool_rate"],
        "pipeline_s": pipeline_s,
        "goal_met": gain_base >= 0.5 and gain_rl >= 0.5 and (by["sft+rl"]["tool_rate"] or 0) >= 0.9
        and pipeline_s is not None and pipeline_s <= 1800,
    }


def _forge(run_dir: Path, args: list[str]) -> dict[str, Any]:
    run = forge(run_dir, args)
    last = next((r for r in reversed(run.rows) if "eval/accuracy" in r), {})
    return {"start": _eval(run.summary.get("eval_start") or {}), "end": _eval(last), "wall_s": run.wall_s,
            "load": run.load}  # fmt: skip


def _eval(row: dict[str, Any]) -> dict[str, Any]:
    return {"accuracy": row.get("eval/accuracy", 0.0), "tool_rate": row.get("eval/reward/used_tool"),
            "tagged": row.get("eval/reward/tagged"), "samples": row.get("eval/samples")}  # fmt: skip


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['model']}: {report['demos']} demonstrations ({report['demos_s']} s), "
             f"SFT {report['sft_steps']} steps, RL {report['rl_steps']} steps after SFT, "
             f"{report['rl_alone_steps']} alone; runs in {report['dir']}",
             "| stage | held-out accuracy | tool-call rate | answers tagged | wall, s |", "|---|---|---|---|---|"]  # fmt: skip
    for s in report["stages"]:
        lines.append(f"| {s['stage']} | {s['accuracy']:.3f} | {_f(s['tool_rate'])} | {_f(s['tagged'])} | {s['wall_s'] or '-'} |")
    v = report["verdict"]
    lines.append(f"SFT+RL over base: {v['gain_over_base_pts']:+.1f} pts, over RL alone: {v['gain_over_rl_pts']:+.1f} pts; "
                 f"RL after SFT adds {v['rl_after_sft_adds_pts']:+.1f} pts; tool-call rate {_f(v['tool_call_rate'])}; "
                 f"pipeline {v['pipeline_s']} s; goal met: {v['goal_met']}")  # fmt: skip
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
