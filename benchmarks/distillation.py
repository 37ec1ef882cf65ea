"""On-policy distillation against the RL demo: how many steps to the teacher's accuracy?

The teacher is a trained policy (a forgerl run directory, exported to a Hugging Face
folder with `forge export`, or a folder); the student is the base model. On the default
demo's task (`arithmetic`, its fixed held-out split), both of these start from the base
model and run the same number of steps, alternating (distillation first in odd rounds, the
RL demo first in even rounds, so that neither always gets the quieter machine):

- **distill**: `forge run --set objective=distill`, the teacher scoring the student's own
  samples (in the trainer's process, or `--teacher-server vllm`);
- **rl**: `forge run` as the demo runs (the rewards' GRPO).

Held-out accuracy is evaluated every `--eval-every` steps (greedy, as the demo evaluates);
the teacher's own accuracy on the same split is measured first (its run's start-of-run
evaluation). Reported: each run's accuracy curve, wall time and the time its teacher took,
and the first step at which each reached the teacher's accuracy within `--margin` (5
points). The bar it measures: distillation gets there in at most half the steps RL needs.

    .venv/bin/python benchmarks/distillation.py --teacher runs/demo --steps 20      # the measurement
    .venv/bin/python benchmarks/distillation.py --teacher runs/demo --teacher-server vllm
    .venv/bin/python benchmarks/distillation.py --smoke                             # tiny model, minutes

`--smoke` makes its own teacher (a 2-step run of the tiny model, exported like any run; or
takes `--teacher`) and runs every part end to end on the tiny model with the hf generator:
it shows the script works, not that anything learns. Extra `--set key=value` go to both runs' `forge run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _forge_cli import FORGE, FinishedRun, check, forge  # benchmarks/ is the script's folder

#: The tiny model's runs: small and quick, every part of the pipeline exercised.
SMOKE = ["--model", "tiny", "--generator", "hf", "--set", "loop.prompts_per_step=2", "--set", "loop.group_size=2",
         "--set", "loop.sampling.max_tokens=12", "--set", "loop.eval_size=4",
         "--set", "trainer.options.autocast_bf16=false"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="the teacher: a forgerl run directory or a Hugging Face folder")
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (the RL demo's 20 by default)")
    parser.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every N steps")
    parser.add_argument("--rounds", type=int, default=1, help="distill/rl pairs, alternating which goes first")
    parser.add_argument("--margin", type=float, default=0.05, help="within this much of the teacher's accuracy")
    parser.add_argument("--teacher-server", choices=("none", "vllm"), default="none")
    parser.add_argument("--reward-weight", type=float, default=0.0, help="distill.reward_weight of the distill runs")
    parser.add_argument("--output", default=None, help="folder of every run (default runs/distillation-<time>)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more --set for both runs")
    parser.add_argument("--distill-set", dest="distill_sets", action="append", default=[],
                        help="more --set for the distill runs only (their own learning rate, say)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, end to end, in minutes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.smoke and not args.teacher:
        parser.error("give --teacher RUN_DIR_OR_FOLDER (or --smoke)")

    out = Path(args.output or f"runs/distillation-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [*(SMOKE if args.smoke else []), *(x for s in args.sets for x in ("--set", s))]
    if args.smoke:
        args.steps = min(args.steps, 3)
    if args.smoke and not args.teacher:
        teacher = _forge_run(out / "teacher-run", [*common, "--steps", "2", "--set", "trainer.options.lr=1e-3"])["dir"]
    else:
        teacher = Path(args.teacher).resolve()
    folder = teacher_folder(teacher, out)
    teacher_acc = teacher_accuracy(teacher, folder, out, common)

    distill = [*common, "--set", "objective=distill", "--set", f"distill.teacher.options.model={folder}",
               "--set", f"distill.teacher.options.server={args.teacher_server}",
               "--set", f"distill.reward_weight={args.reward_weight}",
               *(x for s in args.distill_sets for x in ("--set", s))]  # fmt: skip
    if args.smoke and args.teacher_server == "vllm":
        distill += ["--set", "distill.teacher.options.dtype=float32"]
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [("distill", distill), ("rl", common)]
        for name, extra in order if r % 2 == 0 else order[::-1]:
            result = _forge_run(out / f"{name}-{r + 1}", [*extra, "--steps", str(args.steps),
                                                          "--set", f"loop.eval_every={args.eval_every}"])
            result.update(kind=name, round=r + 1, reached=reached(result["curve"], teacher_acc, args.margin))
            runs.append(result)
    report = {"teacher": str(teacher), "teacher_folder": str(folder), "teacher_accuracy": teacher_acc,
              "margin": args.margin, "steps": args.steps, "runs": [_public(r) for r in runs],
              "verdict": verdict(runs)}  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


def teacher_folder(teacher: Path, out: Path) -> Path:
    """The teacher as a Hugging Face folder: a run directory's newest checkpoint exported
    (`forge export`), a folder as it is."""
    if (teacher / "config.yaml").is_file() and (teacher / "checkpoints").is_dir():
        folder = out / "teacher-hf"
        if not (folder / "config.json").is_file():
            check([*FORGE, "export", str(teacher), "--output", str(folder)], "forge export of the teacher run")
        return folder
    if (teacher / "config.json").is_file():
        return teacher
    sys.exit(f"--teacher {teacher}: neither a forgerl run directory (config.yaml, checkpoints/) nor a Hugging Face folder")


def teacher_accuracy(teacher: Path, folder: Path, out: Path, common: list[str]) -> float:
    """The teacher's held-out accuracy: its run's last evaluation when it is a run of the
    same task, else the start-of-run evaluation of a one-step run of the folder."""
    summary = teacher / "summary.json"
    if summary.is_file():
        value = json.loads(summary.read_text()).get("eval_accuracy_end")
        if value is not None:
            return float(value)
    probe = _forge_run(out / "teacher-eval", [*common, "--model", str(folder), "--steps", "1",
                                              "--set", "loop.eval_at_start=true"])
    return float(probe["eval_start"])


def reached(curve: list[tuple[int, float]], target: float, margin: float) -> int | None:
    """The first evaluated step whose accuracy is within ``margin`` of ``target`` (None: never)."""
    return next((step for step, acc in curve if acc >= target - margin), None)


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round: the steps each needed, and whether distillation needed at most half of RL's."""
    rounds = sorted({r["round"] for r in runs})
    out = []
    for n in rounds:
        by = {r["kind"]: r for r in runs if r["round"] == n}
        d, rl = by["distill"]["reached"], by["rl"]["reached"]
        if d is None:
            ok: bool | None = False
        elif rl is None:
            ok = None  # RL never got there within the steps: run longer to compare
        else:
            ok = d <= rl / 2
        out.append({"round": n, "distill_steps": d, "rl_steps": rl, "distill_at_most_half": ok})
    return {"rounds": out}


def _forge_run(run_dir: Path, args: list[str]) -> dict[str, Any]:
    run = forge(run_dir, ["run", *args])
    result = _result(run)
    if run.load:
        result["load"] = run.load
    return result


def _result(run: FinishedRun) -> dict[str, Any]:
    summary, rows = run.summary, run.rows
    curve = [(0, summary["eval_accuracy_start"])] if summary.get("eval_accuracy_start") is not None else []
    curve += [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {
        "dir": run.dir,
        "wall_s": run.wall_s,
        "eval_start": summary.get("eval_accuracy_start"),
        "eval_end": summary.get("eval_accuracy_end"),
        "curve": curve,
        "time": summary.get("time", {}),
        "teacher_s": round(sum(r.get("time/teacher", 0.0) for r in rows), 1),
        "teacher_failed": sum(r.get("distill/failed", 0) for r in rows),
        "reverse_kl": [round(r["distill/reverse_kl"], 4) for r in rows if "distill/reverse_kl" in r],
    }


def _public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in run.items()}


def print_report(report: dict[str, Any]) -> None:
    print(f"teacher {report['teacher']}: held-out accuracy {report['teacher_accuracy']:.3f} "
          f"(target: within {report['margin']:.2f})")
    print("| run | round | accuracy by step | reached at step | wall, s | teacher, s | load (1-min, before / after) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        curve = ", ".join(f"{s}: {a:.3f}" for s, a in r["curve"])
        load = r.get("load")
        loads = f"{load[0]} / {load[3]}" if load else "-"
        print(f"| {r['kind']} | {r['round']} | {curve} | {r['reached']} | {r['wall_s']} | {r['teacher_s']} | {loads} |")
    for v in report["verdict"]["rounds"]:
        print(f"round {v['round']}: distill reached it at step {v['distill_steps']}, RL at {v['rl_steps']}: "
              f"at most half the steps: {v['distill_at_most_half']}")


if __name__ == "__main__":
    main()
