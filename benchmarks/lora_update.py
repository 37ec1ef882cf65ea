"""What one weight update moves, and what a step costs, with a LoRA adapter against full
fine-tuning, on the ``fsdp`` trainer (one rank).

Run: .venv/bin/python benchmarks/lora_update.py [--model smollm2-135m-instruct|tiny|DIR]
     [--rank 16] [--rounds 3] [--json]

For each mode (``full``, ``lora``) one trainer is built the way a run builds it, trains
``--rounds`` steps on trainer_floor.py's GRPO batch (the first one warm-up) and exports
its weights as the transport would take them. Reported: tensors and bytes per update
(what every transport moves), the export's own time, the median step time, the
trainer's parameter count that gets gradients, and the peak memory of the trainer's
process (each mode runs in a fresh process of its own: its RSS high-water mark,
``getrusage``'s ``ru_maxrss``, with what the process held before the trainer was built).
Bytes are exact; times are of a shared machine (read the ratio). The generator's side
(vLLM's stall while it loads the adapter in place) is measured by
``benchmarks/update_stall.py --lora-rank 16``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_floor import grpo_batch, make_trainer, model_folder


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_alone(model_dir: Path, run_dir: Path, options: dict[str, Any], rounds: int) -> dict[str, Any]:
    """:func:`measure` in a fresh process, so that its peak RSS is this trainer's alone."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(measure, model_dir, run_dir, options, rounds).result()


def measure(model_dir: Path, run_dir: Path, options: dict[str, Any], rounds: int) -> dict[str, Any]:
    batch = grpo_batch(model_dir)
    before = _peak_rss_mib()
    trainer = make_trainer(model_dir, run_dir, options)
    built = _peak_rss_mib()
    try:
        steps, peaks = [], []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            trainer.train_step(batch)
            steps.append(time.perf_counter() - start)
            peaks.append(round(_peak_rss_mib()))
        start = time.perf_counter()
        exported = trainer.export_weights(1)
        export_s = time.perf_counter() - start
        assert exported is not None
        tensors = exported.tensors
        # A tensor under two names (tied embeddings) is sent once.
        unique = {id(t): t for t in tensors.values()}
        return {
            "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in unique.values()),
            "export_s": round(export_s, 4),
            "step_s": round(statistics.median(steps[1:]), 3),
            "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "peak_rss_mib": round(_peak_rss_mib()),
            "rss_before_trainer_mib": round(before),
            "peak_rss_after_build_mib": round(built),
            "peak_rss_after_each_step_mib": peaks,
        }
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, 'tiny', or a folder")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, Path(tmp))
        base = {"autocast_bf16": False}
        results = {
            "full": measure_alone(model_dir, Path(tmp) / "full", base, args.rounds),
            "lora": measure_alone(model_dir, Path(tmp) / "lora", {**base, "lora": {"rank": args.rank}}, args.rounds),
        }
    results["bytes_ratio"] = round(results["full"]["bytes"] / results["lora"]["bytes"], 1)
    if args.json:
        print(json.dumps(results))
        return
    for mode in ("full", "lora"):
        r = results[mode]
        print(
            f"{mode:>5}: {r['tensors']:4d} tensors, {r['bytes'] / 2**20:9.2f} MiB per update, export {r['export_s']:.3f} s, "
            f"step {r['step_s']:.2f} s, {r['trainable_params']:,} trainable parameters, peak RSS "
            f"{r['peak_rss_mib']:,} MiB ({r['rss_before_trainer_mib']:,} MiB before the trainer)"
        )
    print(f"full / lora bytes: {results['bytes_ratio']}x (rank {args.rank})")


if __name__ == "__main__":
    main()
