"""`forge eval` generation throughput on vLLM against vLLM's own offline ``LLM.generate``.

Run: .venv/bin/python benchmarks/eval_throughput.py [--model smollm2-135m-instruct]
     [--problems 64] [--k 4] [--max-tokens 128] [--rounds 3] [--set KEY=VALUE ...] [--json]
     .venv/bin/python benchmarks/eval_throughput.py --smoke    # the tiny model, a few samples

Both sides sample the same requests: the task's held-out problems (the first ``--problems``)
through the model's chat template, ``--k`` samples each, at temperature 1 with the seeds
``forge eval`` gives each sample (core/forgerl/runloop/evaluation.py: ``sample_seed``), one
request per sample. First vLLM offline in a child process (one ``LLM.generate`` call over
every request, timed after a warm-up), then ``forge eval --generator vllm`` as a user runs
it, timed by its own eval phase (summary.json ``time.eval``: generation, scoring and writing
the results file, server start-up left out). Generated tokens per second are compared, the two sides alternated ``--rounds`` times; the
round with the median ratio is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_servers import model_folder, resolved_config
from vllm_throughput import engine_kwargs


def requests_for(config, model_dir: Path, problems: int, k: int) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids and seeds of every sample, as forge eval makes them."""
    from transformers import AutoTokenizer

    from forgerl.registry.plugins import build_registry
    from forgerl.rollouts.rollout import Tokenizing
    from forgerl.runloop.evaluation import sample_seed

    task = (
        build_registry().require("task", config.task.name).build(config.task.options, seed=config.loop.seed)
    )
    held_out = task.eval_problems()[:problems]
    tokenizing = Tokenizing(AutoTokenizer.from_pretrained(model_dir))
    prompts, seeds = [], []
    for g, problem in enumerate(held_out):
        ids = tokenizing.prompt_ids(problem)
        for j in range(k):
            prompts.append(ids)
            seeds.append(sample_seed(config, g, j))
    return prompts, seeds


def offline_child(spec_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"], **spec["engine_kwargs"])  # fmt: skip
    params = [
        SamplingParams(n=1, max_tokens=spec["max_tokens"], temperature=1.0, seed=s) for s in spec["seeds"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    Path(spec["out"]).write_text(json.dumps({"seconds": seconds, "tokens": tokens}))


def run_offline(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": os.path.join(tmp, "out.json")}
        path = os.path.join(tmp, "spec.json")
        Path(path).write_text(json.dumps(spec))
        subprocess.run([sys.executable, __file__, "--offline-child", path], check=True, stdout=sys.stderr)
        return json.loads(Path(spec["out"]).read_text())


def run_forge_eval(
    model: str, problems: int, k: int, max_tokens: int, kv_cache_gb: float, sets: list[str]
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval"
        command = [sys.executable, "-m", "forgerl.cli", "eval", model, "--generator", "vllm", "--problems", str(problems),
                   "--k", str(k), "--temperature", "1.0", "--batch-size", str(problems * k), "--output", str(out),
                   "--set", f"loop.sampling.max_tokens={max_tokens}", "--set", "logging.tensorboard=false",
                   "--set", f"generator.options.kv_cache_gb={kv_cache_gb}", "-q"]  # fmt: skip
        for s in sets:
            command += ["--set", s]
        subprocess.run(command, check=True, stdout=sys.stderr)
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
        return {"seconds": summary["time"]["eval"], "tokens": sum(r["completion_tokens"] for r in records),
                "mean@k": summary["eval_accuracy_end"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--set", action="append", default=[], help="more config, e.g. generator.options.replicas=2"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny model, 4 problems x 2 samples of 8 tokens"
    )
    parser.add_argument("--rounds", type=int, default=3, help="offline and forge eval, alternated; the median ratio")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--offline-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_child:
        offline_child(args.offline_child)
        return
    if args.smoke:
        args.model, args.problems, args.k, args.max_tokens, args.kv_cache_gb = "tiny", 4, 2, 8, 0.25

    config = resolved_config(args.model, [f"generator.options.kv_cache_gb={args.kv_cache_gb}", *args.set])
    model_dir = model_folder(config)
    prompts, seeds = requests_for(config, model_dir, args.problems, args.k)
    options = config.generator.options
    spec = {
        "model": str(model_dir),
        "dtype": config.model.dtype if options.dtype == "auto" else options.dtype,
        "enforce_eager": options.enforce_eager,
        "kv_cache_bytes": int(args.kv_cache_gb * 2**30),
        "prompts": prompts,
        "seeds": seeds,
        "max_tokens": args.max_tokens,
        "engine_kwargs": engine_kwargs(config, model_dir),
    }
    # Alternated, round by round: on a shared machine the load moves between runs, and a
    # round's ratio compares two runs made close together.
    rounds = []
    for _ in range(args.rounds):
        offline = run_offline(spec)
        forge = run_forge_eval(args.model, args.problems, args.k, args.max_tokens, args.kv_cache_gb, args.set)
        for side in (offline, forge):
            side["tokens_per_s"] = round(side["tokens"] / max(side["seconds"], 1e-9), 1)
        rounds.append({"offline": offline, "forge_eval": forge,
                       "ratio": round(forge["tokens_per_s"] / max(offline["tokens_per_s"], 1e-9), 3)})  # fmt: skip
    middle = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    offline, forge = middle["offline"], middle["forge_eval"]
    result = {"model": args.model, "problems": args.problems, "k": args.k, "max_tokens": args.max_tokens,
              "rounds": rounds, "offline": offline, "forge_eval": forge,
              "forge_eval_vs_offline": middle["ratio"]}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.model}: {args.problems} problems x k={args.k}, up to {args.max_tokens} tokens, T=1")
    print(f"  offline LLM.generate  {offline['tokens_per_s']:.0f} tokens/s ({offline['tokens']} tokens)")
    print(f"  forge eval (vllm)     {forge['tokens_per_s']:.0f} tokens/s ({forge['tokens']} tokens, mean@k "
          f"{forge['mean@k']:.3f})")  # fmt: skip
    ratios = ", ".join(f"{r['ratio']:.1%}" for r in rounds)
    print(f"  forge eval / offline: {result['forge_eval_vs_offline']:.1%} (the median of {ratios})")


if __name__ == "__main__":
    main()
