"""Peak memory of chunked vs naive per-token logprobs (forgerl.algorithms.logprobs).

Each variant runs in its own subprocess, so one variant's allocator caches and
high-water mark cannot leak into another's. On CPU the figure is the growth of the
process's peak resident set (VmHWM, reset through /proc/self/clear_refs once the inputs
exist) while the variant runs; on CUDA it is torch.cuda.max_memory_allocated() above
what the inputs occupy. "fwd" runs under no_grad (old / reference logprobs); "fwd+bwd"
keeps the graph and backpropagates, so it includes the gradient of the logits itself
(the same size as the logits, needed by any implementation).

    python benchmarks/logprob_memory.py                      # B=8, T=512, V=49152
    python benchmarks/logprob_memory.py --device cuda --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def _load_logprobs():
    try:
        from forgerl.algorithms import logprobs
    except ImportError:  # not installed: logprobs.py has no package-relative imports
        spec = importlib.util.spec_from_file_location("_forgerl_logprobs", REPO / "core" / "forgerl" / "algorithms" / "logprobs.py")
        logprobs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(logprobs)
    return logprobs


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def _vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def child(args: argparse.Namespace) -> dict:
    import torch

    lp = _load_logprobs()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    b, t, v = args.batch, args.seq, args.vocab
    # Fill in place, row by row: no full-size temporary before the baseline is taken.
    logits = torch.empty(b, t, v, dtype=dtype, device=device)
    for i in range(b):
        logits[i].normal_(generator=None)
    ids = torch.randint(0, v, (b, t), device=device)
    logits.requires_grad_(args.mode == "fwd+bwd")

    def run():
        if args.impl == "naive":
            return lp.naive_selective_logprobs(logits, ids)
        return lp.selective_logprobs(logits, ids, chunk_size=args.chunk)

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _vm_rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    if args.mode == "fwd":
        with torch.no_grad():
            out = run()
    else:
        out = run()
        out.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _vm_hwm_bytes()
    elapsed = time.perf_counter() - start
    assert out.shape == (b, t)
    return {
        "impl": args.impl, "dtype": args.dtype, "mode": args.mode, "device": args.device,
        "batch": b, "seq": t, "vocab": v, "chunk": args.chunk,
        "inputs_mib": (logits.numel() * logits.element_size() + ids.numel() * 8) / MiB,
        "peak_extra_mib": (peak - base) / MiB,
        "seconds": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="chunked", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    rows = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))}
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for impl in ("naive", "chunked"):
                cmd = [sys.executable, __file__, "--child", "--impl", impl, "--dtype", dtype, "--mode", mode,
                       "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
                       "--chunk", str(args.chunk), "--device", args.device]
                out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    sys.exit(f"variant {impl}/{dtype}/{mode} failed:\n{out.stderr}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    r0 = rows[0]
    print(f"B={r0['batch']} T={r0['seq']} V={r0['vocab']} chunk={r0['chunk']} device={r0['device']}")
    print(f"{'dtype':<6}{'mode':<9}{'impl':<9}{'inputs MiB':>11}{'peak extra MiB':>16}{'seconds':>9}")
    for r in rows:
        print(f"{r['dtype']:<6}{r['mode']:<9}{r['impl']:<9}{r['inputs_mib']:>11.0f}"
              f"{r['peak_extra_mib']:>16.0f}{r['seconds']:>9.2f}")


if __name__ == "__main__":
    main()
