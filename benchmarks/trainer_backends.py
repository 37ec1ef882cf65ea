"""``train_step`` of the ``fsdp`` and ``torchtitan`` trainers side by side, same batch,
same dtype, same options.

Run: python benchmarks/trainer_backends.py [--model smollm2-135m-instruct|tiny|DIR]
     [--rounds 5] [--option KEY=JSON ...] [--json]

Each trainer lives in its own worker process (so each one's memory peak is its own),
built once; this process then asks them for one step at a time, alternating which goes
first each round, so both see the same drift of a shared machine. The batch is
trainer_floor.py's realistic GRPO batch (4 prompts x 4 completions up to 64 tokens,
on-policy behaviour logprobs). The first round is warm-up and not counted. Reported per
trainer: median wall and CPU seconds per step (CPU time is the steadier number when
other processes share the cores), and the worker's peak resident memory over its
baseline once the libraries were imported (model, optimizer state, activations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/performance.md

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("fsdp", "torchtitan")


def worker(backend: str, model_dir: Path, run_dir: Path, options: dict[str, Any]) -> None:
    """Build ``backend``'s trainer, then answer "step" with one timed train_step (JSON
    line) until "quit"; the last line reports the memory peak."""
    import dataclasses
    import resource
    import time

    sys.path.insert(0, str(REPO / "benchmarks"))
    from trainer_floor import grpo_batch, run_context

    if backend == "fsdp":
        from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer as Trainer
    else:
        import torchtitan.models.llama3  # noqa: F401 - its import, not the trainer's memory

        from forgerl_plugins.trainers.torchtitan.trainer import TorchTitanTrainer as Trainer
    import transformers  # noqa: F401 - likewise (the fsdp trainer imports it when built)

    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer = Trainer(Trainer.Options(**options), context=run_context(model_dir, run_dir))
    try:
        batch = grpo_batch(model_dir)
        batch = dataclasses.replace(batch, behaviour_logprobs=trainer.logprobs(batch) * batch.loss_mask)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() != "step":
                break
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(batch)
            out = {"wall": time.perf_counter() - start, "cpu": time.process_time() - start_cpu, "loss": metrics["loss"]}
            print(json.dumps(out), flush=True)
    finally:
        trainer.close()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": (peak_kb - baseline_kb) / 1024, "rows": batch.size,
                      "completion_tokens": int((batch.loss_mask != 0).sum())}), flush=True)


class Worker:
    def __init__(self, backend: str, model_dir: Path, run_dir: Path, options: dict[str, Any]) -> None:
        command = [sys.executable, __file__, "--worker", backend, "--model", str(model_dir),
                   "--run-dir", str(run_dir), "--options-json", json.dumps(options)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask(None)  # the "ready" line

    def ask(self, command: str | None) -> dict[str, Any]:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a trainer worker exited ({self.proc.wait()})")
        return json.loads(line)

    def finish(self) -> dict[str, Any]:
        result = self.ask("quit")
        self.proc.wait()
        return result


def main() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from trainer_floor import model_folder, parse_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, 'tiny', or a folder")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each (after one warm-up)")
    parser.add_argument("--option", action="append", default=[], help="trainer option for both, KEY=JSON")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--options-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.model), args.run_dir, json.loads(args.options_json))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, Path(tmp))
        # fp32 unless --option autocast_bf16=... says otherwise (the trainers' default is "auto").
        options = {"lr": 1e-6, "autocast_bf16": False, **parse_options(args.option)}
        # Built one after the other: two model loads at once would time each other.
        workers = {b: Worker(b, model_dir, Path(tmp) / b, options) for b in BACKENDS}
        steps: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
        try:
            for round_ in range(args.rounds + 1):
                for backend in BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]:
                    step = workers[backend].ask("step")
                    if round_ > 0:
                        steps[backend].append(step)
                    if not args.json:
                        warm = " (warm-up)" if round_ == 0 else ""
                        print(f"round {round_}{warm}: {backend} {step['wall']:.2f} s wall, {step['cpu']:.2f} s CPU, "
                              f"loss {step['loss']:.6f}", flush=True)
            ends = {b: w.finish() for b, w in workers.items()}
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.proc.kill()

    result = {
        "model": args.model,
        "options": options,
        "batch": {"rows": ends["fsdp"]["rows"], "completion_tokens": ends["fsdp"]["completion_tokens"]},
        "median_wall_s": {b: statistics.median(s["wall"] for s in steps[b]) for b in BACKENDS},
        "median_cpu_s": {b: statistics.median(s["cpu"] for s in steps[b]) for b in BACKENDS},
        "peak_mb": {b: round(ends[b]["peak_mb"]) for b in BACKENDS},
        "steps": steps,
    }
    result["wall_ratio_torchtitan_over_fsdp"] = result["median_wall_s"]["torchtitan"] / result["median_wall_s"]["fsdp"]
    result["cpu_ratio_torchtitan_over_fsdp"] = result["median_cpu_s"]["torchtitan"] / result["median_cpu_s"]["fsdp"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"\n{args.model}: {result['batch']['rows']} rows, {result['batch']['completion_tokens']} completion tokens; "
          f"options {options}")
    for backend in BACKENDS:
        print(f"  {backend:10s} median {result['median_wall_s'][backend]:.2f} s wall, "
              f"{result['median_cpu_s'][backend]:.2f} s CPU per step; peak +{result['peak_mb'][backend]} MB")
    print(f"  torchtitan / fsdp: wall {result['wall_ratio_torchtitan_over_fsdp']:.2f}, "
          f"CPU {result['cpu_ratio_torchtitan_over_fsdp']:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
