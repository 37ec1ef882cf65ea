"""TRL's side of benchmarks/sft_vs_trl.py: one SFTTrainer run, timed per optimiser step.

Runs inside .venv-trl (trl, transformers, torch; no forgerl), as

    .venv-trl/bin/python benchmarks/_trl_sft_side.py SPEC.json RESULT.json

SPEC (written by sft_vs_trl.py) holds the model folder, the training rows as token ids
with their loss masks (forgerl's rendering of the same demonstrations, in the order
forgerl takes them) and the settings. TRL takes them as a tokenized dataset
(``input_ids`` + ``assistant_masks``: labels are -100 outside the mask), in that order
(a sequential sampler), so both systems train on the same batches. RESULT gets, per
optimiser step, the seconds of the step (TRL's on_step_begin to on_step_end: forward,
backward, clipping, AdamW), the wall time at its end, the batch's non-padding tokens and
the loss.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    t_start = time.perf_counter()

    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = [{"input_ids": r["input_ids"], "assistant_masks": r["loss_mask"]} for r in spec["rows"]]
    dataset = datasets.Dataset.from_list(rows)

    steps: list[dict] = []
    current: dict = {"tokens": 0.0, "loss": 0.0}

    class Timed(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # forgerl's order: the rows as given

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            current["tokens"] += float(inputs["attention_mask"].sum())
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = result[0] if isinstance(result, tuple) else result
            current["loss"] += float(loss.detach())
            return result

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.update(t0=time.perf_counter(), tokens=0.0, loss=0.0)

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step": state.global_step, "seconds": time.perf_counter() - current["t0"],
                          "wall": time.time(), "tokens": current["tokens"], "loss": current["loss"]})

    micro = spec["micro_batch_size"] or spec["batch_size"]
    if spec["batch_size"] % micro:
        sys.exit(f"batch size {spec['batch_size']} is not a multiple of the micro-batch {micro}")
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sft-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=spec["batch_size"] // micro,
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        max_grad_norm=spec["max_grad_norm"],
        gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=spec["bf16"],
        max_length=spec["max_length"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Timed(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[StepTimer()])
    t_train = time.perf_counter()
    trainer.train()
    result = {
        "steps": steps,
        "train_wall_seconds": time.perf_counter() - t_train,
        "startup_seconds": t_train - t_start,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "datasets": datasets.__version__},
        "optimizer": type(trainer.optimizer).__name__,
        "gradient_checkpointing": bool(config.gradient_checkpointing),
    }
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
