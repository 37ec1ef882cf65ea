"""Long-tail completions: the synchronous loop against `keep` + continuous overlap, side by side.

    .venv/bin/python benchmarks/long_tail.py [--budget 330] [--sides sync,keep1] [--rounds 1]
                                             [--max-tokens 256] [--eval-every 4] [--json]

The setting: SmolLM2-135M-Instruct (the default model) on two-digit sums written to a
`file` task, half of the prompts asking for the bare answer in <answer></answer> and half
for step-by-step working before it, at most --max-tokens new tokens at temperature 1, so
completions run from a few tokens to the limit. The benchmark records every completion
(benchmarks/_length_probe.py, a reward of weight 0) and reports the length distribution.

Sides (same seed, same prompts, the same wall-time budget of training, counted from the
loop's first step, after the generator and trainer have started):
- sync:  `loop.max_staleness: 0` (generate, train, update, repeat; update_policy default);
- keepS: `loop.overlap: continuous`, `generator.options.update_policy: keep`,
         `loop.max_staleness: S` (S = 1 or 2).
At the budget the benchmark sends SIGTERM (the loop checkpoints and stops at the step
boundary). Held-out accuracy is the run's own evaluation (greedy, `loop.eval_every`), the
last one before the budget. Trained tokens are the completion tokens in the loss
(`staleness/tokens_age_*` summed), per second of the training window (first step's start
to last step's end, evaluations included on both sides). With --rounds 2 the sides
alternate (A B, then B A); the load average is sampled during each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_trl import LoadSampler, machine, model_folder, versions  # noqa: E402 - benchmarks/ on sys.path

SIDES = {
    "sync": {"loop.max_staleness": 0},
    "keep1": {"loop.max_staleness": 1, "loop.overlap": "continuous", "generator.options.update_policy": "keep"},
    "keep2": {"loop.max_staleness": 2, "loop.overlap": "continuous", "generator.options.update_policy": "keep"},
}
SHORT = "What is {a} + {b}? Reply with only the final answer inside <answer></answer>, nothing else."
STEPS = ("What is {a} + {b}? Explain your working step by step in detail: split both numbers into tens and "
         "ones, add the tens, add the ones, carry if needed, check the result, and only then give the final "
         "answer inside <answer></answer>.")
REWARDS = "rewards=[{name: math_answer, weight: 1.0}, {name: format, weight: 0.2}, {name: length_probe, weight: 0}]"
GRACE_S = 240  # after SIGTERM: the step in progress finishes and the checkpoint is written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=330,
                        help="seconds of training per run, from the loop's start to SIGTERM")
    parser.add_argument("--sides", default="sync,keep1", help="comma-separated: " + ", ".join(SIDES))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating order")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--generator", default="vllm", choices=("vllm", "sglang"))
    parser.add_argument("--keep-runs", action="store_true", help="keep the run folders (printed at the end)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        sys.exit(f"--sides takes names from {', '.join(SIDES)}, got {args.sides!r}")

    def say(*parts) -> None:
        print(*parts, file=sys.stderr if args.json else sys.stdout, flush=True)

    model = model_folder()
    work = Path(tempfile.mkdtemp(prefix="forgerl-long-tail-"))
    train, held_out = write_problems(work, eval_size=args.eval_size)
    load = LoadSampler()
    load.start()
    report: dict = {"machine": machine(), "versions": versions(), "budget_s": args.budget, "model": str(model),
                    "setting": {"max_tokens": args.max_tokens, "prompts_per_step": args.prompts_per_step,
                                "group_size": args.group_size, "eval_every": args.eval_every,
                                "eval_size": args.eval_size, "generator": args.generator},
                    "runs": []}
    try:
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else list(reversed(sides))):
                folder = work / f"{side}-{r + 1}"
                say(f"round {r + 1}/{args.rounds}: {side} for {args.budget:.0f} s ...")
                t0 = time.time()
                try:
                    run = run_side(side, folder, args, train, held_out)
                except SystemExit as failed:  # the shared machine's OOM killer, a start-up timeout
                    say(f"    {side} failed: {failed}")
                    report["failed"] = [*report.get("failed", []), {"side": side, "error": str(failed)}]
                    continue
                run["load_average"] = load.between(t0, time.time())
                run.update(lengths(folder / "completions.jsonl", model))
                report["runs"].append(run)
                say(f"    {run['steps']} steps, {run['trained_tokens_per_s']:.1f} trained tokens/s, idle "
                    f"{run['generator_idle_frac']:.2f}, held-out {run['eval_accuracy']} at step "
                    f"{run['eval_step']}, load {run['load_average']['mean']:.1f}")
    finally:
        load.stop()
        if args.keep_runs:
            say(f"run folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["sides"] = summarise(report["runs"], sides)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


def write_problems(work: Path, *, eval_size: int) -> tuple[Path, Path]:
    """Two-digit sums, alternately short-answer and step-by-step prompts; held out apart."""
    rng = random.Random(0)
    pairs = sorted({(a, b) for a in range(10, 100) for b in range(10, 100)})
    rng.shuffle(pairs)

    def row(i: int, a: int, b: int) -> dict:
        kind = "short" if i % 2 == 0 else "steps"
        prompt = (SHORT if kind == "short" else STEPS).format(a=a, b=b)
        return {"id": f"sum-{a}-{b}", "prompt": [{"role": "user", "content": prompt}], "answer": str(a + b),
                "answer_type": "integer", "kind": kind}

    held_out, train = pairs[:eval_size], pairs[eval_size:eval_size + 4000]
    paths = work / "train.jsonl", work / "eval.jsonl"
    for path, chosen in zip(paths, (train, held_out), strict=True):
        path.write_text("".join(json.dumps(row(i, a, b)) + "\n" for i, (a, b) in enumerate(chosen)))
    return paths


def run_side(side: str, folder: Path, args, train: Path, held_out: Path) -> dict:
    forge = Path(sys.executable).with_name("forge")
    cmd = [str(forge)] if forge.exists() else [sys.executable, "-m", "forgerl.cli"]
    sets = {
        "task.options.path": str(train),
        "task.options.eval_path": str(held_out),
        "loop.prompts_per_step": args.prompts_per_step,
        "loop.group_size": args.group_size,
        "loop.sampling.max_tokens": args.max_tokens,
        "loop.sampling.temperature": 1.0,
        "loop.seed": 0,
        "loop.eval_every": args.eval_every,
        "loop.eval_at_start": "false",
        "checkpoint.every": 0,
        "logging.progress": "false",
        "logging.tensorboard": "false",
        **SIDES[side],
    }
    cmd += ["run", "--steps", "100000", "--output", str(folder), "--task", "file", "--generator", args.generator,
            "--set", REWARDS]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env["FORGE_PLUGINS"] = ",".join(p for p in (env.get("FORGE_PLUGINS"), "_length_probe") if p)
    folder.mkdir(parents=True)
    env["FORGERL_LENGTH_PROBE"] = str(folder / "completions.jsonl")
    log = folder.with_name(folder.name + ".log")
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t_train = training_started(folder / "events.jsonl", proc, log)
        try:
            proc.wait(timeout=max(0.0, t_train + args.budget - time.time()))
            sys.exit(f"forge run ended before the budget ({proc.returncode}); last lines of {log}:\n{_tail(log)}")
        except subprocess.TimeoutExpired:
            pass
        t_stop = time.time()
        # SIGTERM to `forge run` (the local scheduler's supervisor) stops every process of
        # the run; metrics.jsonl already holds a row for every step finished by now.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the run's processes only
            proc.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()] \
        if (folder / "metrics.jsonl").exists() else []
    rows = [r for r in rows if r["time/wall"] <= t_stop]  # steps finished within the budget
    if not rows:
        sys.exit(f"{side}: no step finished within {args.budget:.0f} s; last lines of {log}:\n{_tail(log)}")
    window = rows[-1]["time/wall"] - (rows[0]["time/wall"] - rows[0]["time/step"])
    loss_tokens = sum(v for r in rows for k, v in r.items() if k.startswith("staleness/tokens_age_"))
    evals = [r for r in rows if "eval/accuracy" in r]
    sums = {p: sum(r[f"time/{p}"] for r in rows) for p in ("generate", "reward", "train", "sync", "wait_rollouts")}
    return {
        "side": side, "run_dir": str(folder), "steps": len(rows), "window_s": round(window, 1),
        "startup_s": round(t_train - t0, 1),
        "trained_tokens": loss_tokens,
        "trained_tokens_per_s": loss_tokens / window,
        # Prompt and completion tokens the trainer ran (attention mask), for comparison.
        "attended_tokens_per_s": sum(r["throughput/train_tokens_per_s"] * r["time/train"] for r in rows) / window,
        "generator_idle_frac": statistics.fmean(r["time/generator_idle_frac"] for r in rows),
        "time_split_s": {k: round(v, 1) for k, v in sums.items()},
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
        "dropped_stale": sum(r["samples/dropped_stale"] for r in rows),
        "reward_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:]),
        "eval_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "eval_step": evals[-1]["step"] if evals else None,
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
        # CPU seconds of all the run's processes (reaped children), launch to exit, over its wall time.
        "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1),
        "wall_s": round(time.time() - t0, 1),
    }


def training_started(events: Path, proc: subprocess.Popen, log: Path, *, limit_s: float = 900) -> float:
    """When the loop announced its first step (events.jsonl): the budget counts from there, so
    the generator's start-up (1.5 min for vLLM on a loaded 2-core machine) is no part of it."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"forge run ended during start-up ({proc.returncode}); last lines of {log}:\n{_tail(log)}")
        if events.exists():
            for line in events.read_text().splitlines():
                event = json.loads(line) if line.strip().endswith("}") else {}
                if event.get("stage") == "loop" and event.get("state") == "start":
                    return float(event["time"])
        time.sleep(1)  # polling a file another process appends to; no event to wait on
    proc.kill()
    sys.exit(f"forge run did not start training within {limit_s:.0f} s; see {log}")


def lengths(path: Path, model: Path) -> dict:
    """Completion lengths in tokens (re-tokenised text), overall and per prompt kind."""
    if not path.exists():
        return {"lengths": None}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    out: dict = {}
    for kind in ("all", "short", "steps"):
        ns = sorted(len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in rows
                    if kind == "all" or r["kind"] == kind)
        if ns:
            out[kind] = {"n": len(ns), "p10": _quantile(ns, 0.1), "p50": _quantile(ns, 0.5),
                         "p90": _quantile(ns, 0.9), "max": ns[-1],
                         "truncated": sum(r["finish"] == "length" for r in rows if kind == "all" or r["kind"] == kind)}
    return {"lengths": out}


def _quantile(ordered: list[int], p: float) -> int:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def summarise(runs: list[dict], sides: list[str]) -> dict:
    out: dict = {}
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        out[side] = {"trained_tokens_per_s": statistics.fmean(r["trained_tokens_per_s"] for r in mine),
                     "steps": [r["steps"] for r in mine],
                     "eval_accuracy": [r["eval_accuracy"] for r in mine]}
    base = out[sides[0]]["trained_tokens_per_s"] if sides[0] in out else float("nan")
    for side in out:
        out[side]["ratio"] = out[side]["trained_tokens_per_s"] / base
    return out


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"\nmachine: {m['cpu']} ({m['cores']} cores); budget {report['budget_s']:.0f} s per run; "
          f"setting {report['setting']}")
    head = (f"{'run':10}{'steps':>6}{'start s':>8}{'window s':>9}{'tok/s':>8}{'idle':>6}{'gen s':>7}"
            f"{'train s':>8}{'sync s':>7}{'wait s':>7}{'cpu/wall':>9}{'stale':>6}{'acc@step':>10}{'load':>6}")
    print(head)
    for r in report["runs"]:
        t = r["time_split_s"]
        print(f"{r['side'] + '-' + r['run_dir'][-1]:10}{r['steps']:>6}{r['startup_s']:>8.0f}{r['window_s']:>9.0f}"
              f"{r['trained_tokens_per_s']:>8.1f}{r['generator_idle_frac']:>6.2f}{t['generate']:>7.0f}"
              f"{t['train']:>8.0f}{t['sync']:>7.0f}{t['wait_rollouts']:>7.0f}{r['cpu_s'] / r['wall_s']:>9.2f}"
              f"{r['staleness_mean']:>6.2f}{str(r['eval_accuracy']) + '@' + str(r['eval_step']):>10}"
              f"{r['load_average']['mean']:>6.1f}")
    for r in report["runs"]:
        print(f"{r['side']}: completion tokens {r['lengths']}; eval curve {r['eval_curve']}")
    for failed in report.get("failed", []):
        print(f"{failed['side']}: FAILED: {failed['error'].splitlines()[0]}")
    for side, s in report["sides"].items():
        print(f"{side}: {s['trained_tokens_per_s']:.1f} trained tokens/s ({s['ratio']:.2f}x), "
              f"held-out {s['eval_accuracy']}, steps {s['steps']}")


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    main()
