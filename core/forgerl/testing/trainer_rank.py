"""One trainer rank of the trainer kit's two-rank check, as a scheduler starts it.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python -m forgerl.testing.trainer_rank SPEC.json

``SPEC.json`` names the backend, its options, the plugins to load, the model folder, the
run config, the checkpoint directory (on storage both ranks see) and an output directory.
The rank builds the trainer through the registry with ``context.rank``/``world_size`` from
the environment, runs :func:`forgerl.testing.trainer_support.rank_scenario`, and writes
``OUT/rank<r>.json`` (metrics, which exports returned weights); rank 0 also writes
``OUT/weights.safetensors`` (the weights after the first step). A failure prints its
traceback and exits 1.

A rank ends as a run's worker does (:func:`forgerl.worker.exit_now`): once its files are
written it exits without interpreter finalization, which once aborted a finished gloo rank
in CI ('terminate called without an active exception'), and a crash in native code prints
every thread's Python stack into the rank's log.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from forgerl.testing.registry import registry_for
    from forgerl.testing.trainer_support import rank_scenario, run_context, temperature_of

    spec = json.loads(Path(argv[0]).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out"])
    context = run_context(Path(spec["model_dir"]), Path(spec["run_dir"]), spec["config"], rank, world_size)
    record = registry_for(spec["plugins"]).require("trainer", spec["backend"])
    trainer = record.build(dict(spec["options"]), context=context)
    try:
        result = rank_scenario(trainer, Path(spec["model_dir"]), Path(spec["checkpoint"]), temperature_of(spec["config"]))
    finally:
        trainer.close()
    result.pop("initial")  # the one-rank run in the test's process has it
    weights = result.pop("weights")
    if weights is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    faulthandler.enable()
    from forgerl.worker import exit_now

    # A failure propagates: the interpreter prints it and exits 1, as for the worker.
    exit_now(main(sys.argv[1:]))
