"""The ``fsdp`` trainer's ``train_step`` against a bare transformers step on the same batch.

Run: .venv/bin/python benchmarks/trainer_floor.py [--model smollm2-135m-instruct|tiny|DIR]
     [--rounds 5] [--profile] [--option KEY=VALUE ...] [--json]

One process holds two copies of the model, each with its own AdamW:

* ``bare``: what a hand-written GRPO step costs: one forward over the whole batch
  (trailing padding columns cut), ``log_softmax`` + ``gather`` of the completion tokens,
  the same GRPO loss (``forgerl.algorithms.policy_loss``), backward, gradient clipping
  (the trainer's default ``max_grad_norm``), ``AdamW.step``. No FSDP, no micro-batches,
  no entropy metric.
* ``bare_head``: the same, with the LM head applied to the completion positions only
  (``model.model`` for the hidden states, then ``lm_head`` on the rows the loss reads):
  the tighter floor, for Llama-style models.
* ``fsdp``: ``FSDPTrainer.train_step`` on one rank (gloo, in-process store), built the
  way the trainer tests build it, with its default options unless ``--option`` says
  otherwise.

Both train on the same realistic GRPO batch: 4 prompts (chat template, ~40 tokens) x 4
completions of varied length up to 64 tokens, right-padded, loss mask on the completion
tokens, group-relative advantages of both signs, behaviour logprobs from the policy
itself. Rounds alternate bare / fsdp (the machine is shared, so absolute times drift;
the ratio of medians is the number to read); the first round of each is warm-up and not
counted. Each step is timed twice: wall clock, and this process's CPU time, which other
processes on a busy machine disturb far less (it counts the work of torch's threads, which
wait passively, so it is the steadier number when cores are shared). ``--profile`` runs
one more ``train_step`` under ``torch.profiler`` and reports where its time goes (the
trainer labels its phases ``forge.*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/performance.md

REPO = Path(__file__).resolve().parents[1]
TEMPERATURE = 1.0
PROMPTS = [
    "What is 17 + 25? Answer with the number only, then explain in one sentence.",
    "A farmer has 12 sheep and buys 9 more. How many sheep does the farmer have now?",
    "Write the sum of 38 and 46, and say whether the result is even or odd.",
    "Tom reads 14 pages a day for 3 days. How many pages has he read in total?",
]


def model_folder(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from forgerl_plugins.models.tiny import TinyModel, build_tiny_model

        return build_tiny_model(TinyModel.Options(), cache_dir=tmp)
    from forgerl.configuration.config import build_config
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve

    config = resolve(build_config(flags={"model": name}, sets=[]), build_registry())
    return resolve_model(config.model, build_registry())


def grpo_batch(model_dir: Path, completions_per_prompt: int = 4, max_completion: int = 64, seed: int = 0):
    """Prompts through the chat template, completions of varied length (random ids: the
    cost of a step depends on shapes, not on what the tokens say), right-padded."""
    import torch
    from transformers import AutoTokenizer

    from forgerl.algorithms import group_advantages
    from forgerl.types import TrainBatch

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for text in PROMPTS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for k in range(completions_per_prompt):
            # One completion per group runs to the limit, the others stop early.
            n = max_completion if k == 0 else int(torch.randint(8, max_completion, (1,), generator=gen))
            completion = torch.randint(3, vocab, (n,), generator=gen).tolist()
            rows.append((prompt_ids, completion))
    length = max(len(p) + len(c) for p, c in rows)
    size = len(rows)
    input_ids = torch.full((size, length), pad, dtype=torch.long)
    attention = torch.zeros(size, length, dtype=torch.long)
    loss_mask = torch.zeros(size, length, dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        loss_mask[i, len(p) : len(p) + len(c)] = 1
    rewards = torch.rand(len(PROMPTS), completions_per_prompt, generator=gen)
    advantages = group_advantages(rewards).reshape(-1).float()
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=torch.zeros(size, length),
        advantages=advantages,
        policy_versions=torch.zeros(size, dtype=torch.long),
        num_groups=len(PROMPTS),
    )


def run_context(model_dir: Path, run_dir: Path):
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext

    config = RunConfig.model_validate({"loop": {"seed": 0, "sampling": {"temperature": TEMPERATURE}}})
    return RunContext.for_run(config, run_dir, model_path=model_dir, rank=0, world_size=1)


def make_trainer(model_dir: Path, run_dir: Path, options: dict[str, Any]):
    from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(FSDPTrainer.Options(**options), context=run_context(model_dir, run_dir))


class BareStep:
    """A plain transformers GRPO step, the floor the trainer is measured against."""

    def __init__(
        self, model_dir: Path, algorithm, lr: float, betas, weight_decay: float, max_grad_norm,
        head_at_completions: bool = False,
    ):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.algorithm = algorithm
        self.max_grad_norm = max_grad_norm
        self.head_at_completions = head_at_completions

    def __call__(self, batch) -> float:
        import torch

        from forgerl.algorithms import policy_loss

        length = int(batch.attention_mask.sum(-1).max())
        ids = batch.input_ids[:, :length]
        attention = batch.attention_mask[:, :length]
        if self.head_at_completions:
            where = batch.loss_mask[:, 1:length] != 0
            hidden = self.model.model(input_ids=ids, attention_mask=attention).last_hidden_state
            logits = self.model.lm_head(hidden[:, :-1][where])
            targets = ids[:, 1:][where].unsqueeze(-1)
            picked = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, targets)
            logprobs = logits.new_zeros(where.shape).masked_scatter(where, picked.squeeze(-1))
        else:
            logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            logprobs = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss, _ = policy_loss(
            logprobs,
            logprobs.detach() if self.algorithm.ratio == "old" else None,  # as the trainer's
            batch.behaviour_logprobs[:, 1:length],
            batch.advantages,
            batch.loss_mask[:, 1:length],
            self.algorithm,
        )
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def profile_step(trainer, batch, top: int = 15) -> dict[str, Any]:
    """Self CPU time by op and total time of the trainer's ``forge.*`` phases, one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        trainer.train_step(batch)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e6 for e in events if e.key.startswith(("forge.", "FSDP::"))}
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_s": wall,
        "phases_s": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        "top_self_ops_s": {e.key: e.self_cpu_time_total / 1e6 for e in ops},
    }


def parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option takes KEY=VALUE, got {pair!r}")
        out[key] = json.loads(value) if value[:1] in "0123456789-[{tfn" else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, 'tiny', or a folder")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each (after one warm-up)")
    parser.add_argument("--option", action="append", default=[], help="fsdp trainer option, KEY=JSON")
    parser.add_argument("--profile", action="store_true", help="profile one more train_step")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, Path(tmp))
        # fp32 unless --option autocast_bf16=... says otherwise: the bare step it is held to is fp32.
        options = {"lr": 1e-6, "autocast_bf16": False, **parse_options(args.option)}
        trainer = make_trainer(model_dir, Path(tmp) / "run", options)
        try:
            batch = grpo_batch(model_dir)
            # On-policy behaviour logprobs: importance ratios start at 1, as in a real step.
            batch = dataclasses.replace(batch, behaviour_logprobs=trainer.logprobs(batch) * batch.loss_mask)
            opts = trainer.options
            bare_args = (trainer.algorithm, opts.lr, tuple(opts.betas), opts.weight_decay, opts.max_grad_norm)
            bare = BareStep(model_dir, *bare_args)
            bare_head = BareStep(model_dir, *bare_args, head_at_completions=True)
            steps = {
                "bare": lambda: bare(batch),
                "bare_head": lambda: bare_head(batch),
                "fsdp": lambda: trainer.train_step(batch),
            }
            times: dict[str, list[float]] = {name: [] for name in steps}
            cpu: dict[str, list[float]] = {name: [] for name in steps}
            for round_ in range(args.rounds + 1):
                for name in list(steps) if round_ % 2 == 0 else list(steps)[::-1]:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    steps[name]()
                    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
                    if round_ > 0:
                        times[name].append(seconds)
                        cpu[name].append(cpu_seconds)
                    if not args.json:
                        warm = " (warm-up)" if round_ == 0 else ""
                        print(f"round {round_}{warm}: {name} {seconds:.2f} s wall, "
                              f"{cpu_seconds:.2f} s CPU", flush=True)
            profile = profile_step(trainer, batch) if args.profile else None
        finally:
            trainer.close()

    medians = {k: statistics.median(v) for k, v in times.items()}
    cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
    mask = batch.loss_mask[:, 1:] != 0
    result = {
        "model": args.model,
        "batch": {
            "rows": batch.size,
            "padded_length": int(batch.input_ids.shape[1]),
            "attended_tokens": int(batch.attention_mask.sum()),
            "completion_tokens": int(mask.sum()),
        },
        "options": options,
        "threads": torch.get_num_threads(),
        "seconds": times,
        "cpu_seconds": cpu,
        "median_s": medians,
        "median_cpu_s": cpu_medians,
        "ratio_fsdp_over_bare": medians["fsdp"] / medians["bare"],
        "cpu_ratio_fsdp_over_bare": cpu_medians["fsdp"] / cpu_medians["bare"],
        "cpu_ratio_fsdp_over_bare_head": cpu_medians["fsdp"] / cpu_medians["bare_head"],
    }
    if profile is not None:
        result["profile"] = profile
    if args.json:
        print(json.dumps(result, indent=2))
        return
    b = result["batch"]
    print(
        f"\nbatch: {b['rows']} rows x {b['padded_length']} (attended {b['attended_tokens']}, "
        f"completion {b['completion_tokens']} tokens); {result['threads']} threads; options {options}"
    )
    for label, m in (("wall", medians), ("CPU", cpu_medians)):
        print(f"median {label} s/step: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items())
              + f"; fsdp/bare {m['fsdp'] / m['bare']:.2f}, fsdp/bare_head {m['fsdp'] / m['bare_head']:.2f}")
    if profile is not None:
        print(f"\nprofiled train_step: {profile['wall_s']:.2f} s wall")
        for key, value in profile["phases_s"].items():
            print(f"  {key:40s} {value:7.3f} s")
        print("top ops by self CPU time:")
        for key, value in profile["top_self_ops_s"].items():
            print(f"  {key:40s} {value:7.3f} s")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
