"""The ``fsdp`` trainer's ``train_step`` against the machine's matmul ceiling (MFU).

Run: .venv/bin/python benchmarks/trainer_mfu.py [--model smollm2-135m-instruct|tiny|DIR]
     [--rounds 3] [--option KEY=JSON ...] [--threads N] [--json]

1. **Count.** One ``train_step`` on trainer_floor.py's realistic GRPO batch (4 prompts x 4
   completions up to 64 tokens, on-policy behaviour logprobs) runs under a dispatch mode
   that records every matrix product torch executes: ``mm``/``addmm``/``bmm``/``baddbmm``
   and the fused attention kernels, with their shapes, strides and dtypes, and whether
   autograd's backward ran them. FLOPs are counted from those shapes, not from a formula
   of the model: a product of ``[m, k] @ [k, n]`` is ``2*m*k*n``; attention is its two
   products (``Q @ K^T`` and ``P @ V``, ``2*s_q*s_k*d`` each per head) over the pairs the
   kernel computes: the full ``s_q x s_k`` square when it is handed a mask (transformers
   passes the causal + padding mask, so the masked half is computed too), the lower
   triangle for an ``is_causal`` kernel; its backward counts twice its forward (the
   convention of torch.utils.flop_counter; the CPU kernel also recomputes ``Q @ K^T``,
   which is not counted). What the trainer runs is what is
   counted: the LM head only at the completion positions (the trainer's head selection),
   padding positions inside the batch's rows, the backward's products for both inputs
   and weights. Element-wise work (norms, softmax, casts, the optimizer) counts nothing.
2. **Ceiling.** Every distinct product of the step is then run alone on the same cores,
   with the same shapes and strides (attention as the two batched products of its
   shapes), in bf16 and in fp32, the fastest of 3 runs each, weighted by how often the
   step ran it. Its FLOPs over that time is the ceiling in each precision for *this
   step's* products; a 2048 x 2048 product in each precision is reported beside it.
3. **Rounds** alternate the step, the bf16 replay and the fp32 replay (order rotated);
   after one warm-up step, medians of ``--rounds`` rounds. The step is timed by wall
   clock (and this process's CPU time, for a shared machine).

Achieved FLOP/s = counted FLOPs / step wall time; MFU = achieved / ceiling. The trainer
runs with its default options (``autocast_bf16: auto``: bf16 autocast where the CPU has
``avx512_bf16`` or AMX); the report says which precision the step ran in, and which
dtype its products had.
"""

from __future__ import annotations

import argparse
import collections
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
sys.path.insert(0, str(REPO / "benchmarks"))

from trainer_floor import grpo_batch, make_trainer, model_folder, parse_options  # noqa: E402

#: Runs of each product alone; the fastest counts (a ceiling).
REPLAY_RUNS = 3

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product the step ran (or a fused attention, as its two products)."""

    kind: str  # "mm" or "bmm" (a batched product, attention's included)
    part: str  # "decoder" (the layers' projections), "head" (LM head), "attention"
    phase: str  # "forward" or "backward"
    a: tuple[Shape, Shape]  # shape and strides of the left operand
    b: tuple[Shape, Shape]
    dtype: str
    flops: int  # counted FLOPs of one run


def _operand(t: Any) -> tuple[Shape, Shape]:
    return tuple(t.shape), tuple(t.stride())


def _dense(shape: Shape) -> tuple[Shape, Shape]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return shape, tuple(reversed(strides))


class ProductRecorder:
    """A TorchDispatchMode (made lazily: torch is imported after the argument parsing)
    that counts the matrix products of whatever runs under it."""

    def __init__(self, vocab: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.vocab = vocab
        self.counts: collections.Counter[Product] = collections.Counter()
        self.unknown: collections.Counter[str] = collections.Counter()
        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                recorder.record(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> ProductRecorder:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    def record(self, func: Any, args: tuple, kwargs: dict) -> None:
        import torch

        name = func.overloadpacket.__name__
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        if name in ("mm", "addmm"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            m, k, n = a.shape[0], a.shape[1], b.shape[1]
            part = "head" if self.vocab in (m, k, n) else "decoder"
            self._add("mm", part, phase, _operand(a), _operand(b), a.dtype, 2 * m * k * n)
        elif name in ("bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
            batch, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
            self._add("bmm", "attention", phase, _operand(a), _operand(b), a.dtype, 2 * batch * m * k * n)
        elif "attention" in name and name.startswith("_scaled_dot_product"):
            backward = name.endswith("_backward")
            q, k = (args[1], args[2]) if backward else (args[0], args[1])
            is_causal = _is_causal(func, args, kwargs)
            self._attention(q, k, is_causal, "backward" if backward else phase, backward)
        elif "mm" in name or "attention" in name or "conv" in name:
            self.unknown[str(func)] += 1  # a product this count does not know: reported

    def _attention(self, q: Any, k: Any, is_causal: bool, phase: str, backward: bool) -> None:
        *lead, s_q, d = q.shape
        s_k = k.shape[-2]
        heads = 1
        for x in lead:
            heads *= x
        # The pairs a causal kernel computes: the lower triangle, diagonal included.
        pairs = s_q * (s_q + 1) // 2 if is_causal and s_q == s_k else s_q * s_k
        scale = 2 if backward else 1  # backward = 2x forward (torch.utils.flop_counter's rule)
        for a_shape, b_shape in (((heads, s_q, d), (heads, d, s_k)), ((heads, s_q, s_k), (heads, s_k, d))):
            flops = scale * 2 * heads * pairs * d
            self._add("bmm", "attention", phase, _dense(a_shape), _dense(b_shape), q.dtype, flops)

    def _add(self, kind: str, part: str, phase: str, a: Any, b: Any, dtype: Any, flops: int) -> None:
        self.counts[Product(kind, part, phase, a, b, str(dtype).removeprefix("torch."), int(flops))] += 1

    @property
    def flops(self) -> int:
        return sum(p.flops * n for p, n in self.counts.items())

    def breakdown(self) -> dict[str, int]:
        out: dict[str, int] = collections.defaultdict(int)
        for p, n in self.counts.items():
            out[f"{p.phase}/{p.part}"] += p.flops * n
        return dict(sorted(out.items()))


def _is_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            if arg.name in kwargs:
                return bool(kwargs[arg.name])
            return bool(args[i]) if i < len(args) else bool(arg.default_value)
    return False


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def product_seconds(p: Product, dtype: Any, device: Any, runs: int = REPLAY_RUNS) -> tuple[float, float]:
    """Wall and CPU seconds of ``p`` alone in ``dtype`` (the fastest of ``runs`` runs of
    each), scaled to the FLOPs the step counts for it (attention: the full square runs,
    the counted share of it is taken)."""
    import torch

    def operand(spec: tuple[Shape, Shape]) -> Any:
        shape, stride = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).normal_()

    a, b = operand(p.a), operand(p.b)
    op = torch.mm if p.kind == "mm" else torch.bmm
    out = op(a, b)  # warm: the first call of a shape may pick its kernel
    full = 2 * out.numel() * p.a[0][-1]
    wall = cpu = float("inf")
    for _ in range(runs):
        _sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        op(a, b, out=out)
        _sync(device)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall * p.flops / full, cpu * p.flops / full


def replay(counts: collections.Counter[Product], dtype: Any, device: Any) -> tuple[float, float]:
    """Wall and CPU seconds the step's products take alone in ``dtype`` (each as often as
    the step ran it)."""
    wall = cpu = 0.0
    for p, n in counts.items():
        w, c = product_seconds(p, dtype, device)
        wall, cpu = wall + n * w, cpu + n * c
    return wall, cpu


def square_flops_per_s(dtype: Any, device: Any, n: int = 2048) -> float:
    p = Product("mm", "reference", "forward", _dense((n, n)), _dense((n, n)), "", 2 * n**3)
    return p.flops / product_seconds(p, dtype, device)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, 'tiny', or a folder")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up step)")
    parser.add_argument("--option", action="append", default=[], help="fsdp trainer option, KEY=JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, Path(tmp))
        # The trainer's defaults (autocast_bf16: auto), a learning rate that keeps the
        # weights near the checkpoint over the rounds.
        options = {"lr": 1e-6, **parse_options(args.option)}
        trainer = make_trainer(model_dir, Path(tmp) / "run", options)
        try:
            batch = grpo_batch(model_dir)
            batch = dataclasses.replace(batch, behaviour_logprobs=trainer.logprobs(batch) * batch.loss_mask)
            trainer.train_step(batch)  # warm-up
            recorder = ProductRecorder(int(trainer.model.config.vocab_size))
            with recorder:
                trainer.train_step(batch)
            device = trainer.device
            phases = {
                "step": lambda: trainer.train_step(batch),
                "bf16": lambda: replay(recorder.counts, torch.bfloat16, device),
                "fp32": lambda: replay(recorder.counts, torch.float32, device),
            }
            seconds: dict[str, list[float]] = {k: [] for k in phases}
            cpu_seconds: dict[str, list[float]] = {k: [] for k in phases}
            squares: dict[str, list[float]] = {"bf16": [], "fp32": []}
            names = list(phases)
            for round_ in range(args.rounds):
                for name in names[round_ % 3 :] + names[: round_ % 3]:
                    start, cpu = time.perf_counter(), time.process_time()
                    result = phases[name]()
                    if name == "step":
                        seconds[name].append(time.perf_counter() - start)
                        cpu_seconds[name].append(time.process_time() - cpu)
                    else:
                        seconds[name].append(result[0])
                        cpu_seconds[name].append(result[1])
                squares["bf16"].append(square_flops_per_s(torch.bfloat16, device))
                squares["fp32"].append(square_flops_per_s(torch.float32, device))
                if not args.json:
                    print(
                        f"round {round_ + 1}: "
                        + ", ".join(
                            f"{k} {v[-1]:.2f} s (CPU {cpu_seconds[k][-1]:.2f} s)" for k, v in seconds.items()
                        ),
                        flush=True,
                    )
            autocast = bool(trainer.autocast_bf16)
        finally:
            trainer.close()

    flops = recorder.flops
    med = {k: statistics.median(v) for k, v in seconds.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_seconds.items()}
    achieved = flops / med["step"]
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
        "load_average": os.getloadavg(),
        "step_precision": "bf16 autocast (fp32 master weights)" if autocast else "fp32",
        "product_dtypes": sorted({p.dtype for p in recorder.counts}),
        "flops": flops,
        "flops_by_part": recorder.breakdown(),
        "products": sum(recorder.counts.values()),
        "uncounted_ops": dict(recorder.unknown),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "median_s": med,
        "median_cpu_s": med_cpu,
        "achieved_flops_per_s": achieved,
        "ceiling_flops_per_s": {k: flops / med[k] for k in ("bf16", "fp32")},
        "mfu": {k: med[k] / med["step"] for k in ("bf16", "fp32")},
        # The same from CPU time (steadier where other processes share the cores).
        "mfu_cpu": {k: med_cpu[k] / med_cpu["step"] for k in ("bf16", "fp32")},
        "square_2048_flops_per_s": {k: statistics.median(v) for k, v in squares.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    b = result["batch"]
    print(
        f"\nbatch: {b['rows']} rows x {b['padded_length']} (attended {b['attended_tokens']}, completion "
        f"{b['completion_tokens']} tokens); {result['threads']} threads; step in {result['step_precision']}, "
        f"products in {', '.join(result['product_dtypes'])}"
    )
    print(f"counted: {flops / 1e9:.1f} GFLOP in {result['products']} products per step")
    for key, value in result["flops_by_part"].items():
        print(f"  {key:22s} {value / 1e9:8.1f} GFLOP ({value / flops:5.1%})")
    if result["uncounted_ops"]:
        print(f"  not counted (unknown products): {result['uncounted_ops']}")
    print(
        f"train_step: {med['step']:.2f} s wall (CPU {med_cpu['step']:.2f} s) -> {achieved / 1e9:.0f} GFLOP/s"
    )
    for k in ("bf16", "fp32"):
        ceiling = result["ceiling_flops_per_s"][k]
        print(
            f"the step's products alone in {k}: {med[k]:.2f} s (CPU {med_cpu[k]:.2f} s) -> {ceiling / 1e9:.0f} "
            f"GFLOP/s; MFU vs {k} {result['mfu'][k]:.2f} (by CPU time {result['mfu_cpu'][k]:.2f}); "
            f"2048^2 {k} {result['square_2048_flops_per_s'][k] / 1e9:.0f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
