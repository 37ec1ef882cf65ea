"""Weight-update latency into a running vLLM server, against a plain memcpy of the same bytes.

Run: .venv/bin/python benchmarks/vllm_weight_update.py [--model smollm2-135m-instruct]
     [--transport shm|nccl|rdma] [--rounds 3] [--ties shared|copied|both] [--json]

One server is started by the plugin's role (as ``forge run`` does); the benchmark plays
the trainer: it holds the model in fp32 under Hugging Face names, and for each version it
sends the full weights through the chosen transport while ``VLLMGenerator.update_weights``
loads them, exactly as the loop's ``sync_weights`` does. Reported per round:

* ``sync``: wall time of the whole step (sender writes, replica pauses, its worker
  receives and reloads, the tied head is repacked, prefix cache reset, resume);
* ``send``: the sender's part (for shm, writing the version into /dev/shm; for nccl and
  rdma, until every receiver acknowledged it);
* ``worker``: what the vLLM worker spent receiving and reloading;
* the baseline: one memcpy of the same number of bytes between two warm buffers.

After the last round one completion is checked against transformers on the new weights.

``--ties``: how the tied embedding is handed to the transport. ``shared`` (what the
trainers export): ``lm_head.weight`` is ``model.embed_tokens.weight``, one tensor, which
shm writes once. ``copied``: a separate copy under each name, as the trainers exported it
before (every byte travels twice). ``both`` alternates the two round by round and reports
each one's median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_servers import model_folder, plugin_servers, resolved_config


def memcpy_seconds(nbytes: int, repeat: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in: measure the copy, not the allocation
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return min(times)


def check_logprobs(gen, model, tokenizer) -> float:
    import torch

    from forgerl.types import GenerationRequest, SamplingParams

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True, tokenize=False
    )
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    (comp,) = asyncio.run(gen.generate([GenerationRequest("check", ids, 1, SamplingParams(max_tokens=16))]))[
        0
    ]
    with torch.no_grad():
        logits = model(torch.tensor([ids + comp.token_ids])).logits[0, len(ids) - 1 : -1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(-1)
    return float((torch.tensor(comp.logprobs) - want).abs().max())


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgerl.types import WeightSet

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--transport", default="shm", help="a transport's name: shm, nccl, rdma")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="more config, e.g. transport.timeout=300")
    parser.add_argument("--ties", choices=("shared", "copied", "both"), default="shared")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    config = resolved_config(args.model, ["generator.options.kv_cache_gb=1", *args.set], args.transport)
    model_dir = model_folder(config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rounds = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        plugin_servers(config, Path(tmp) / "run", model_dir) as (gen, sender),
    ):
        modes = ["shared", "copied"] if args.ties == "both" else [args.ties]
        for version in range(1, args.rounds * len(modes) + 1):
            ties = modes[(version - 1) % len(modes)]
            with torch.no_grad():  # a real change, so that the check below means something
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            errors: list[BaseException] = []

            def load(v: int = version, errors: list[BaseException] = errors) -> None:
                try:
                    gen.update_weights(v)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            start = time.perf_counter()
            loader = threading.Thread(target=load)
            loader.start()
            state = model.state_dict()
            if ties == "copied":
                state["lm_head.weight"] = state["lm_head.weight"].clone()
            sender.send(WeightSet(version, state))
            loader.join()
            sync = time.perf_counter() - start
            if errors:
                raise errors[0]
            workers = [w for loads in gen.updater.last_update["workers"].values() for w in loads]
            rounds.append(
                {
                    "version": version,
                    "ties": ties,
                    "sync_s": sync,
                    "send_s": sender.last_send_seconds,
                    "sent_bytes": sender.last_send_bytes,
                    "generator_s": gen.updater.last_update["seconds"],
                    "worker_s": max(w["seconds"] for w in workers),
                    "worker_wait_s": max(w.get("wait_seconds", 0.0) for w in workers),
                    "worker_read_s": max(w.get("read_seconds", 0.0) for w in workers),
                    "worker_load_s": max(w.get("load_seconds", 0.0) for w in workers),
                }
            )
        gap = check_logprobs(gen, model, tokenizer)
    # What the transport carried: the largest version (with copied ties, the embedding twice).
    sent = max(r["sent_bytes"] for r in rounds)
    baseline = memcpy_seconds(sent)
    by_ties = {
        mode: {
            "median_sync_s": statistics.median(r["sync_s"] for r in rounds if r["ties"] == mode),
            "median_send_s": statistics.median(r["send_s"] for r in rounds if r["ties"] == mode),
            "median_worker_s": statistics.median(r["worker_s"] for r in rounds if r["ties"] == mode),
            "sent_bytes": next(r["sent_bytes"] for r in rounds if r["ties"] == mode),
        }
        for mode in modes
    }
    median_sync = statistics.median(r["sync_s"] for r in rounds)
    result = {
        "model": args.model,
        "transport": args.transport,
        "bytes_sent": sent,
        "memcpy_s": baseline,
        "rounds": rounds,
        "by_ties": by_ties,
        "median_sync_s": median_sync,
        "sync_vs_memcpy": median_sync / baseline,
        "logprob_gap_after_update": gap,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.model} through {args.transport}: up to {sent / 2**20:.0f} MiB per version (fp32)")
    print(
        f"  memcpy of the same bytes: {result['memcpy_s'] * 1e3:.0f} ms ({sent / result['memcpy_s'] / 1e9:.1f} GB/s)"
    )
    for r in rounds:
        print(
            f"  version {r['version']} (ties {r['ties']}, {r['sent_bytes'] / 2**20:.0f} MiB): sync {r['sync_s']:.2f} s "
            f"= send {r['send_s']:.2f} s (trainer side) overlapping the worker's {r['worker_s']:.2f} s (waits "
            f"{r['worker_wait_s']:.2f}, reads {r['worker_read_s']:.2f}, vLLM loads+repacks {r['worker_load_s']:.2f}); "
            f"pause/resume etc. {r['sync_s'] - r['worker_s']:.2f} s"
        )
    for mode, m in by_ties.items():
        print(
            f"  ties {mode}: median sync {m['median_sync_s']:.2f} s, send {m['median_send_s']:.2f} s, "
            f"worker {m['median_worker_s']:.2f} s ({m['sent_bytes'] / 2**20:.0f} MiB)"
        )
    print(f"  median sync / memcpy: {result['sync_vs_memcpy']:.0f}x; logprob gap after the update: {gap:.1e}")


if __name__ == "__main__":
    main()
