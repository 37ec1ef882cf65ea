"""Runs torchtitan trainer scenarios on every rank of a torch.distributed launch.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT \\
        python tests/helpers/torchtitan_worker.py --model KEY=DIR ... --out DIR --scenario NAME ...

Rank 0 writes ``OUT/NAME.safetensors`` (the exported weights after the scenario's steps),
``OUT/NAME.logprobs.safetensors`` (the logprobs before the first step) and
``OUT/NAME.json`` (the metrics of every step). The parity test runs the same scenarios
with the ``fsdp`` trainer on one rank in its own process (:func:`run_scenario`) and
compares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

from tests.helpers import fsdp_worker

#: name -> (model key, batch rows, micro-batch size, steps, algorithm overrides, torchtitan options)
SCENARIOS: dict[str, tuple[str, int, int, int, dict[str, Any], dict[str, Any]]] = {
    # FSDP over 2 ranks: 3 + 2 rows in micro-batches of 2, so rank 1 runs a padding
    # micro-batch; a (sharded) reference model for the KL term, recomputed old logprobs.
    "fsdp2": ("biased", 5, 2, 2, {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "ratio": "old"}, {}),
    # Tensor parallel over 2 ranks (both train the same rows): heads, their biases and the
    # feed-forward split; decoder layers recomputed in the backward pass.
    "tp2": ("wide", 3, 2, 1, {"loss_agg": "token_mean"}, {"tp": 2, "activation_checkpointing": "full"}),
}


def make_trainer(kind: str, model_dir: Path, run_dir: Path, micro: int, algorithm: dict[str, Any],
                 rank: int = 0, world_size: int = 1, **options: Any):
    """A ``torchtitan`` or ``fsdp`` trainer with the options the parity tests share."""
    if kind == "fsdp":
        return fsdp_worker.make_trainer(model_dir, run_dir, micro, algorithm, rank, world_size, **options)
    from forgerl_plugins.trainers.torchtitan import TorchTitanTrainerOptions
    from forgerl_plugins.trainers.torchtitan.trainer import TorchTitanTrainer

    opts = TorchTitanTrainerOptions(**{"lr": 1e-4, "micro_batch_size": micro, **options})
    context = fsdp_worker.make_context(model_dir, run_dir, algorithm, rank, world_size)
    return TorchTitanTrainer(opts, context=context)


def run_scenario(kind: str, name: str, model_dir: Path, run_dir: Path, rank: int = 0, world_size: int = 1):
    """Build a ``kind`` trainer, train the scenario's steps; return (trainer, logprobs
    before the first step, metrics per step, exported weights or None off rank 0). The
    caller closes the trainer. fsdp ignores the torchtitan options (its one rank holds
    every row and the whole model)."""
    _, rows, micro, steps, algorithm, options = SCENARIOS[name]
    config = json.loads((model_dir / "config.json").read_text())
    trainer = make_trainer(kind, model_dir, run_dir, micro, algorithm, rank, world_size,
                           **(options if kind == "torchtitan" else {}))
    batch = fsdp_worker.make_batch(rows, config["vocab_size"], config["pad_token_id"], seed=len(name))
    logprobs = trainer.logprobs(batch)
    batch = fsdp_worker.on_policy(trainer, batch)
    metrics = [trainer.train_step(batch) for _ in range(steps)]
    return trainer, logprobs, metrics, trainer.export_weights(steps)


def main() -> None:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, help="KEY=DIR")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", action="append", required=True, choices=sorted(SCENARIOS))
    args = parser.parse_args()
    models = {key: Path(path) for key, path in (m.split("=", 1) for m in args.model)}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = []
    for name in args.scenario:
        model_dir = models[SCENARIOS[name][0]]
        trainer, logprobs, metrics, weights = run_scenario("torchtitan", name, model_dir, args.out, rank, world_size)
        trainers.append(trainer)
        if rank == 0:
            assert weights is not None, "rank 0 must receive the exported weights"
            save_file({k: v.clone() for k, v in weights.tensors.items()}, args.out / f"{name}.safetensors")
            save_file({"logprobs": logprobs.contiguous()}, args.out / f"{name}.logprobs.safetensors")
            (args.out / f"{name}.json").write_text(json.dumps(metrics))
        else:
            assert weights is None, f"rank {rank} got weights; only rank 0 should"
    # The first trainer created the process group: close it last.
    for trainer in reversed(trainers):
        trainer.close()


if __name__ == "__main__":
    main()
