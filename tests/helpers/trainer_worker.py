"""The ``fsdp`` and ``torchtitan`` trainers as the trainer tests build them, and the
scenarios the two-rank tests run on every rank of a launch:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT \\
        python tests/helpers/trainer_worker.py --trainer KIND --model KEY=DIR ... --out DIR --scenario NAME ...

(:func:`forgerl.testing.trainer_support.beside_two_ranks` starts it so). Rank 0 writes
``OUT/NAME.safetensors`` (the exported weights after the scenario's steps),
``OUT/NAME.logprobs.safetensors`` (the logprobs before the first step) and ``OUT/NAME.json``
(the metrics of every step). The test runs the same scenarios with ``fsdp`` on one rank in
its own process (:func:`run_scenario`) and compares. Batches come from
:func:`forgerl.testing.trainer_support.make_batch`, the trainer kit's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

TEMPERATURE = 0.7
TRAINERS = ("fsdp", "torchtitan")


@dataclass(frozen=True)
class Scenario:
    model: str  # the key of the model folder (--model KEY=DIR)
    rows: int
    micro_batch_size: int
    steps: int
    algorithm: dict[str, Any]
    trainers: tuple[str, ...] = TRAINERS  # which trainers run it on 2 ranks
    torchtitan: dict[str, Any] = field(default_factory=dict)  # options fsdp has no use for
    fsdp: dict[str, Any] = field(default_factory=dict)  # options of fsdp alone (on 1 and 2 ranks)


SCENARIOS: dict[str, Scenario] = {
    # 5 rows on 2 ranks: 3 + 2 rows in micro-batches of 2, so rank 1 runs a padding
    # micro-batch; a (sharded) reference model for the KL term, recomputed old logprobs.
    "uneven": Scenario("biased", 5, 2, 2, {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "ratio": "old"}),
    # 1 row on 2 ranks: rank 1 has no rows at all and must still join every collective.
    "empty_rank": Scenario("biased", 1, 1, 2, {"loss_agg": "token_mean"}, trainers=("fsdp",)),
    # Tensor parallel over 2 ranks (both train the same rows): heads, their biases and the
    # feed-forward split; decoder layers recomputed in the backward pass.
    "tp2": Scenario("wide", 3, 2, 1, {"loss_agg": "token_mean"}, trainers=("torchtitan",),
                    torchtitan={"tp": 2, "activation_checkpointing": "full"}),
    # A LoRA adapter sharded with its decoder layers (frozen base weights and trainable A
    # and B in one FSDP2 unit), with the KL term against the base model (adapter off).
    # Both trainers draw the same A from the run's seed, so torchtitan's adapter on 2 ranks
    # (PEFT's layers inside TorchTitan's recomputed decoder layers) is held to fsdp's on 1.
    "lora": Scenario("biased", 5, 2, 2, {"loss_agg": "token_mean", "kl_coef": 0.1},
                     fsdp={"lora": {"rank": 4, "alpha": 8}},
                     torchtitan={"lora": {"rank": 4, "alpha": 8}, "activation_checkpointing": "full"}),
}


def make_batch(model_dir: Path, rows: int, seed: int, length: int = 16):
    """The trainer kit's batch, padded with the model's pad token (so that a plain
    transformers forward pass can take its ids as they are)."""
    from forgerl.testing.trainer_support import make_batch as kit_batch

    pad = json.loads((model_dir / "config.json").read_text())["pad_token_id"]
    return kit_batch(model_dir, rows, seed, length=length, pad_id=pad)


def on_policy(trainer, batch):
    """The batch with behaviour logprobs from the trainer's current policy (as if its
    weights had sampled it), so importance ratios start at 1."""
    import dataclasses

    lp = trainer.logprobs(batch) * batch.loss_mask
    return dataclasses.replace(batch, behaviour_logprobs=lp)


def with_token_versions(batch, trainer_version: int = 2):
    """The batch trained at ``trainer_version`` with per-token versions: every odd row's first
    two completion tokens one version older (as if sampled before a weight update), the rest
    current; the trainer then reports the logprob gap by age (``logprob_gap/age_<a>``)."""
    import dataclasses

    import torch

    versions = torch.full(batch.input_ids.shape, trainer_version, dtype=torch.long)
    for row in range(1, batch.size, 2):
        first = int(batch.loss_mask[row].nonzero()[0])
        versions[row, first : first + 2] = trainer_version - 1
    return dataclasses.replace(batch, token_versions=versions, trainer_version=trainer_version)


def weights(trainer, version: int = 0) -> dict:
    """The trainer's exported weights, copied (on one rank, which is rank 0 and gets them)."""
    exported = trainer.export_weights(version)
    assert exported is not None, "a single rank is rank 0 and must get the weights"
    return {k: v.clone() for k, v in exported.tensors.items()}


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference between same-named tensors of two weight sets with the same
    names, and where."""
    assert a.keys() == b.keys(), f"different names: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)


def attended_diff(a, b, batch) -> float:
    """The largest difference between two ``[B, T]`` logprobs where a token is predicted
    (from position 1 on, attended)."""
    attended = batch.attention_mask[:, 1:] != 0
    return (a[:, 1:] - b[:, 1:]).abs()[attended].max().item()


def make_trainer(
    model_dir: Path,
    run_dir: Path,
    micro_batch_size: int,
    algorithm: dict[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
    kind: str = "fsdp",
    **options: Any,
):
    """A ``kind`` trainer (``fsdp`` or ``torchtitan``) with the options the trainer tests
    share, built as a run builds it (through the registry)."""
    from forgerl.testing.registry import registry_for
    from forgerl.testing.trainer_support import run_config, run_context

    config = run_config({"algorithm": algorithm or {}}, TEMPERATURE)
    context = run_context(model_dir, run_dir, config, rank, world_size)
    # fp32 whatever the CPU: these tests compare trainers and reference steps to 1e-5.
    options = {"lr": 1e-4, "micro_batch_size": micro_batch_size, "autocast_bf16": False, **options}
    return registry_for().require("trainer", kind).build(options, context=context)


def run_scenario(kind: str, name: str, model_dir: Path, run_dir: Path, rank: int = 0, world_size: int = 1):
    """Build a ``kind`` trainer, train the scenario's steps; return (trainer, logprobs
    before the first step, metrics per step, exported weights or None off rank 0). The
    caller closes the trainer. fsdp ignores the torchtitan options (its one rank holds
    every row and the whole model)."""
    s = SCENARIOS[name]
    options = s.torchtitan if kind == "torchtitan" else s.fsdp
    trainer = make_trainer(model_dir, run_dir, s.micro_batch_size, s.algorithm, rank, world_size, kind, **options)
    batch = make_batch(model_dir, s.rows, seed=len(name))
    logprobs = trainer.logprobs(batch)
    batch = with_token_versions(on_policy(trainer, batch))
    metrics = [trainer.train_step(batch) for _ in range(s.steps)]
    return trainer, logprobs, metrics, trainer.export_weights(s.steps)


def main() -> None:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True, choices=TRAINERS)
    parser.add_argument("--model", action="append", required=True, help="KEY=DIR")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", action="append", required=True, choices=sorted(SCENARIOS))
    args = parser.parse_args()
    models = {key: Path(path) for key, path in (m.split("=", 1) for m in args.model)}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = []
    for name in args.scenario:
        model_dir = models[SCENARIOS[name].model]
        trainer, logprobs, metrics, weights = run_scenario(args.trainer, name, model_dir, args.out, rank, world_size)
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
