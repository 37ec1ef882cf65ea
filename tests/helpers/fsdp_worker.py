"""Runs FSDP trainer scenarios on every rank of a torch.distributed launch.

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port PORT tests/helpers/fsdp_worker.py --model DIR --out DIR \\
        --scenario NAME ...

Rank 0 writes ``OUT/NAME.safetensors`` (the exported weights after the scenario's steps)
and ``OUT/NAME.json`` (the metrics of every step). The test runs the same scenarios in
its own process on one rank (this module is imported by path) and compares.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

#: name -> (batch rows, micro-batch size, steps, algorithm overrides)
SCENARIOS: dict[str, tuple[int, int, int, dict[str, Any]]] = {
    # 5 rows on 2 ranks: 3 + 2 rows in micro-batches of 2, so rank 1 runs a padding
    # micro-batch; with a (sharded) reference model, KL term, recomputed old logprobs.
    "uneven": (5, 2, 2, {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "ratio": "old"}),
    # 1 row on 2 ranks: rank 1 has no rows at all and must still join every collective.
    "empty_rank": (1, 1, 2, {"loss_agg": "token_mean"}),
}

TEMPERATURE = 0.7


def make_batch(rows: int, vocab_size: int, pad_id: int, seed: int = 0, length: int = 16):
    """A right-padded batch of prompt + completion rows with varied lengths, advantages
    of both signs and zero behaviour logprobs (set them with :func:`on_policy`)."""
    import torch

    from forgerl.types import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros(rows, length, dtype=torch.long)
    loss_mask = torch.zeros(rows, length, dtype=torch.float32)
    for i in range(rows):
        prompt = int(torch.randint(3, 7, (1,), generator=gen))
        completion = int(torch.randint(2, length - prompt + 1, (1,), generator=gen))
        n = prompt + completion
        input_ids[i, :n] = torch.randint(3, vocab_size, (n,), generator=gen)
        attention[i, :n] = 1
        loss_mask[i, prompt:n] = 1
    advantages = torch.randn(rows, generator=gen)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=torch.zeros(rows, length),
        advantages=advantages,
        policy_versions=torch.zeros(rows, dtype=torch.long),
        num_groups=1,
    )


def on_policy(trainer, batch):
    """The batch with behaviour logprobs from the trainer's current policy (as if its
    weights had sampled it), so importance ratios start at 1."""
    import dataclasses

    lp = trainer.logprobs(batch) * batch.loss_mask
    return dataclasses.replace(batch, behaviour_logprobs=lp)


def make_context(
    model_dir: Path,
    run_dir: Path,
    algorithm: dict[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
):
    from forgerl.config import RunConfig
    from forgerl.interfaces import RunContext

    config = RunConfig.model_validate(
        {
            "algorithm": algorithm or {},
            "loop": {"seed": 0, "sampling": {"temperature": TEMPERATURE}},
        }
    )
    return RunContext(config=config, run_dir=run_dir, model_path=model_dir, rank=rank, world_size=world_size)


def make_trainer(
    model_dir: Path,
    run_dir: Path,
    micro_batch_size: int,
    algorithm: dict[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
    **options: Any,
):
    from forgerl_plugins.trainers.fsdp import FSDPTrainerOptions
    from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer

    opts = FSDPTrainerOptions(**{"lr": 1e-4, "micro_batch_size": micro_batch_size, **options})
    return FSDPTrainer(opts, context=make_context(model_dir, run_dir, algorithm, rank, world_size))


def run_scenario(name: str, model_dir: Path, run_dir: Path, rank: int = 0, world_size: int = 1):
    """Build a trainer, train the scenario's steps; return (trainer, metrics per step,
    exported weights or None off rank 0). The caller closes the trainer."""
    import json as _json

    rows, micro, steps, algorithm = SCENARIOS[name]
    config = _json.loads((model_dir / "config.json").read_text())
    trainer = make_trainer(model_dir, run_dir, micro, algorithm, rank, world_size)
    batch = on_policy(trainer, make_batch(rows, config["vocab_size"], config["pad_token_id"], seed=len(name)))
    metrics = [trainer.train_step(batch) for _ in range(steps)]
    weights = trainer.export_weights(steps)
    return trainer, metrics, weights


def main() -> None:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", action="append", required=True, choices=sorted(SCENARIOS))
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = []
    for name in args.scenario:
        trainer, metrics, weights = run_scenario(name, args.model, args.out, rank, world_size)
        trainers.append(trainer)
        if rank == 0:
            assert weights is not None, "rank 0 must receive the exported weights"
            save_file({k: v.clone() for k, v in weights.tensors.items()}, args.out / f"{name}.safetensors")
            (args.out / f"{name}.json").write_text(json.dumps(metrics))
        else:
            assert weights is None, f"rank {rank} got weights; only rank 0 should"
    # The first trainer created the process group: close it last.
    for trainer in reversed(trainers):
        trainer.close()


if __name__ == "__main__":
    main()
