"""Generation throughput through the vllm plugin against vLLM's own offline ``LLM.generate``.

Run: .venv/bin/python benchmarks/vllm_throughput.py [--model smollm2-135m-instruct]
     [--prompts 16] [--n 4] [--max-tokens 64] [--rounds 3] [--json]

Both sides get the same prompts (the arithmetic task's, through the model's chat
template, as the loop sends them), the same sampling (T = 1, logprobs of the sampled
token, a seed per prompt as the loop sends) and the same engine settings (dtype, eager,
KV cache size, logprobs mode, and on vLLM's CPU build whole prefills, which seeds need
there). First
vLLM offline in a child process, then one server started by the plugin's role and driven
through ``VLLMGenerator.generate`` (HTTP, one request per prompt with ``n``). Each side
warms up once, then runs ``--rounds`` timed rounds; generated tokens per second of the
best round are compared. Goal: the plugin reaches >= 90% of offline (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_servers import model_folder, plugin_servers, resolved_config


def prompts_for(config, model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from forgerl.registry.plugins import build_registry
    from forgerl.rollouts.rollout import Tokenizing

    task = build_registry().require("task", config.task.name).build(config.task.options, seed=0)
    tokenizing = Tokenizing(AutoTokenizer.from_pretrained(model_dir))
    return [tokenizing.prompt_ids(p) for p in task.next_problems(count)]


# ------------------------------------------------------------------- offline (child)


def offline_child(spec_path: str) -> None:
    """vLLM's offline engine on the same prompts (runs in its own interpreter: vLLM spawns
    workers, and the plugin's servers must not share the cores with it)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=spec["enforce_eager"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        logprobs_mode="processed_logprobs",
        **spec["engine_kwargs"],
    )
    params = [
        SamplingParams(
            n=spec["n"], max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0, logprobs=0, seed=i
        )
        for i in range(len(spec["prompts"]))
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    rounds = []
    for _ in range(spec["rounds"]):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        rounds.append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    Path(spec["out"]).write_text(json.dumps(rounds))


def run_offline(spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": os.path.join(tmp, "out.json")}
        path = os.path.join(tmp, "spec.json")
        Path(path).write_text(json.dumps(spec))
        # vLLM logs to stdout: keep it off ours (--json prints there).
        subprocess.run([sys.executable, __file__, "--offline-child", path], check=True, stdout=sys.stderr)
        return json.loads(Path(spec["out"]).read_text())


def engine_kwargs(config, model_dir: Path) -> dict:
    """What the plugin's server adds for seeds on the CPU build, as ``LLM(...)`` arguments."""
    from forgerl_plugins.generators.vllm import server
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator

    options = VLLMGenerator.Options.model_validate(config.generator.options)
    if not (server.is_cpu_build() and options.send_seed):
        return {}
    args = server.whole_prefill_args(options, model_dir)
    return {k: v for k, v in args.items() if v is not None}


# ------------------------------------------------------------------------- plugin


def run_plugin(
    config, model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, rounds: int
) -> list[dict]:
    from forgerl.types import GenerationRequest, SamplingParams

    requests = [
        GenerationRequest(f"p{i}", ids, n, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
        for i, ids in enumerate(prompts)
    ]
    out = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        plugin_servers(config, Path(tmp) / "run", model_dir) as (gen, _),
    ):
        asyncio.run(gen.generate(requests[:1]))  # warm-up
        for _ in range(rounds):
            start = time.perf_counter()
            results = asyncio.run(gen.generate(requests))
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for cs in results for c in cs)
            out.append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--set", action="append", default=[], help="more config, e.g. model.options.hidden_size=128"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--offline-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_child:
        offline_child(args.offline_child)
        return

    config = resolved_config(args.model, [f"generator.options.kv_cache_gb={args.kv_cache_gb}", *args.set])
    model_dir = model_folder(config)
    prompts = prompts_for(config, model_dir, args.prompts)
    options = config.generator.options  # the resolved config's VLLMGenerator.Options
    spec = {
        "model": str(model_dir),
        "dtype": config.model.dtype if options.dtype == "auto" else options.dtype,
        "enforce_eager": options.enforce_eager,
        "kv_cache_bytes": int(args.kv_cache_gb * 2**30),
        "prompts": prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "engine_kwargs": engine_kwargs(config, model_dir),
    }
    offline = run_offline(spec)
    plugin = run_plugin(config, model_dir, prompts, args.n, args.max_tokens, args.rounds)
    best_offline = max(r["tokens_per_s"] for r in offline)
    best_plugin = max(r["tokens_per_s"] for r in plugin)
    result = {
        "model": args.model,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "offline_rounds": offline,
        "plugin_rounds": plugin,
        "offline_tokens_per_s": round(best_offline, 1),
        "plugin_tokens_per_s": round(best_plugin, 1),
        "plugin_vs_offline": round(best_plugin / best_offline, 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.model}: {args.prompts} prompts x n={args.n}, up to {args.max_tokens} tokens, T=1")
    for name, rounds in (("offline LLM.generate", offline), ("plugin (HTTP)", plugin)):
        shown = ", ".join(f"{r['tokens_per_s']:.0f}" for r in rounds)
        print(f"  {name:22s} tokens/s per round: {shown}")
    print(f"  plugin / offline (best rounds): {result['plugin_vs_offline']:.1%}  (goal >= 90%)")


if __name__ == "__main__":
    main()
