"""TRL's side of benchmarks/vs_trl.py: one GRPOTrainer run, timed per step and per phase.

Runs inside .venv-trl (trl, transformers, torch; no forgerl), as

    .venv-trl/bin/python benchmarks/_trl_side.py SPEC.json RESULT.json

SPEC (written by vs_trl.py) holds the model folder, the training problems in the order
forgerl's task draws them (chat messages, reference answer, and the prompt token ids forgerl
sends to its generator), the held-out problems and the settings. RESULT gets per-step
timings (step, generation, reward, training), token counts, rewards, held-out accuracy
before and after training (greedy), and every training completion with the reward it got,
so vs_trl.py can re-score them with forgerl's own reward classes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trl_rewards as rewards  # stdlib only; vs_trl.py checks it against forgerl


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    t_start = time.perf_counter()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    _check_prompt_ids(tokenizer, spec["train"] + spec["eval"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    eval_start = _evaluate(model, tokenizer, spec["eval"], spec["max_tokens"])

    # What the reward functions and the timed methods saw, per optimisation step.
    seen: dict[str, list] = {"rows": [], "completions": []}
    current: dict = {}

    def math_answer(prompts, completions, answer, problem_id, **_):
        values = []
        for completion, reference, pid in zip(completions, answer, problem_id, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            value, correct, _tagged = rewards.math_answer(text, reference)
            values.append(value)
            current["correct"].append(float(correct))
            total = rewards.total_reward(text, reference)
            current["rewards"].append(total)
            current["problem_ids"].append(pid)
            seen["completions"].append({"text": text, "answer": reference, "reward": total})
        return values

    def format_reward(prompts, completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [rewards.format_reward(t) for t in texts]

    class TimedGRPOTrainer(GRPOTrainer):
        # Phase timings measured around TRL's own methods: generation (transformers'
        # generate), rewards, and all of generate-and-score (tokenising, decoding,
        # advantages); training is the rest of the optimisation step.
        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                current["generate"] += time.perf_counter() - t

        def _calculate_rewards(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                current["reward"] += time.perf_counter() - t

        def _generate_and_score_completions(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            current["score_total"] += time.perf_counter() - t
            completion = int(out["completion_mask"].sum())
            current["gen_tokens"] += completion
            current["train_tokens"] += completion + int(out["prompt_mask"].sum())
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current.update(generate=0.0, reward=0.0, score_total=0.0, gen_tokens=0, train_tokens=0,
                           rewards=[], correct=[], problem_ids=[], t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - current["t0"]
            seen["rows"].append({
                "step": state.global_step,
                "time/step": step_s,
                "time/generate": current["generate"],
                "time/reward": current["reward"],
                "time/generate_and_score": current["score_total"],
                "time/train": step_s - current["score_total"],
                "gen_tokens": current["gen_tokens"],
                "train_tokens": current["train_tokens"],
                "reward/mean": _mean(current["rewards"]),
                "correct": _mean(current["correct"]),
                "problem_ids": list(dict.fromkeys(current["problem_ids"])),
            })

    dataset = Dataset.from_list(
        [{"prompt": p["messages"], "answer": p["answer"], "problem_id": p["id"]} for p in spec["train"]]
    )
    P, G, micro = spec["prompts_per_step"], spec["group_size"], spec["micro_batch_size"] or spec["trl_default_micro_batch"]
    if (P * G) % micro:
        sys.exit(f"prompts x group ({P} x {G}) must be a multiple of the micro-batch size {micro}")
    with tempfile.TemporaryDirectory(prefix="trl-side-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            max_steps=spec["steps"],
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=P * G // micro,  # one optimiser step per P x G completions
            num_generations=G,
            max_completion_length=spec["max_tokens"],
            temperature=spec["temperature"],
            top_p=1.0,
            top_k=0,
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch_fused",
            adam_beta1=spec["betas"][0],
            adam_beta2=spec["betas"][1],
            weight_decay=spec["weight_decay"],
            max_grad_norm=spec["max_grad_norm"],
            beta=0.0,
            loss_type="grpo",
            scale_rewards="group",
            epsilon=spec["clip"],
            num_iterations=1,
            reward_weights=[rewards.WEIGHTS["math_answer"], rewards.WEIGHTS["format"]],
            shuffle_dataset=False,  # forgerl's prompt order
            # Both systems in fp32, or both under bf16 autocast with fp32 master weights
            # (TRL's own default, and forgerl's where the CPU has native bf16).
            bf16=spec.get("bf16", False),
            # TRL defaults to recomputing activations in the backward pass; forgerl's fsdp
            # trainer keeps them, so by default the two do the same arithmetic per step.
            gradient_checkpointing=spec.get("gradient_checkpointing", False),
            fp16=False,
            use_cpu=not torch.cuda.is_available(),
            seed=spec["seed"],
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_pin_memory=False,
        )
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=[math_answer, format_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        t_train = time.perf_counter()
        trainer.train()
        train_wall = time.perf_counter() - t_train
        trained = trainer.model

    t_eval = time.perf_counter()
    eval_end = _evaluate(trained, tokenizer, spec["eval"], spec["max_tokens"])
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "rows": seen["rows"],
        "eval_accuracy_start": eval_start,
        "eval_accuracy_end": eval_end,
        "eval_end_seconds": time.perf_counter() - t_eval,
        "train_wall_seconds": train_wall,
        "total_seconds": time.perf_counter() - t_start,
        "completions": seen["completions"],
    }
    out_path.write_text(json.dumps(result))


def _check_prompt_ids(tokenizer, problems) -> None:
    """TRL tokenises chat prompts with one batched apply_chat_template call; the ids must be
    those forgerl sends to its generator, or the two systems would not see the same input."""
    tokenized = tokenizer.apply_chat_template(
        conversation=[p["messages"] for p in problems],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    for p, ids in zip(problems, tokenized["input_ids"], strict=True):
        if list(ids) != p["prompt_ids"]:
            sys.exit(f"prompt {p['id']}: TRL's token ids {list(ids)[:12]}... differ from "
                     f"forgerl's {p['prompt_ids'][:12]}...")


def _evaluate(model, tokenizer, problems, max_tokens: int) -> float:
    """Held-out accuracy as forgerl measures it: greedy, one sample per problem, correct per
    math_answer (a right answer, tagged or found by the fallback)."""
    import torch

    width = max(len(p["prompt_ids"]) for p in problems)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p["prompt_ids"])) + p["prompt_ids"] for p in problems])
    mask = torch.tensor([[0] * (width - len(p["prompt_ids"])) + [1] * len(p["prompt_ids"]) for p in problems])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=pad,
        )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return _mean(float(rewards.math_answer(t, p["answer"])[1]) for t, p in zip(texts, problems, strict=True))


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
