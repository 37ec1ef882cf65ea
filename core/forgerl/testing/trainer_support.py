"""What the trainer kit's checks are made of: the batches a run would train on, the logprobs
a plain Hugging Face forward pass gives for them, the run context a trainer is built with,
and the scenario both a single rank and each of two ranks run (:mod:`.trainer_rank`).

Everything here builds the trainer the way a run does, through the public registry
(``registry.require("trainer", name).build(options, context=...)``); torch and transformers
are imported when a function needs them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.interfaces import RunContext, Trainer
    from forgerl.types import TrainBatch

T = TypeVar("T")

#: Metric keys that measure time or speed: a resumed trainer may differ there.
TIMING_PREFIXES = ("time/", "throughput/", "perf/")


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` written over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def run_config(overrides: Mapping[str, Any], temperature: float) -> dict[str, Any]:
    """The run config (plain data) the kit's trainers are built with: a fixed seed, the
    sampling temperature whose logprobs the trainer must compute, then ``overrides``."""
    return merged({"loop": {"seed": 0, "sampling": {"temperature": temperature}}}, overrides)


def run_context(
    model_dir: Path, run_dir: Path, config: Mapping[str, Any], rank: int = 0, world_size: int = 1
) -> RunContext:
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import RunContext

    return RunContext.for_run(
        RunConfig.model_validate(dict(config)),
        Path(run_dir),
        model_path=Path(model_dir),
        rank=rank,
        world_size=world_size,
    )


def temperature_of(config: Mapping[str, Any]) -> float:
    """The temperature logprobs are computed at: the sampling temperature, 1 when greedy."""
    t = float(config["loop"]["sampling"]["temperature"])
    return t if t > 0 else 1.0


# ------------------------------------------------------------------------ batches


def make_batch(
    model_dir: Path, rows: int, seed: int, length: int = 16, zero_advantages: bool = False, pad_id: int = -100
) -> TrainBatch:
    """A right-padded batch of prompt + completion rows of varied lengths (as the loop lays
    one out), advantages of both signs (or all zero), behaviour logprobs still zero (set
    them with :func:`on_policy`). Padding ids are ``pad_id``: -100 by default, as the loop
    may leave them."""
    import torch

    from forgerl.types import TrainBatch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros(rows, length, dtype=torch.long)
    loss_mask = torch.zeros(rows, length, dtype=torch.float32)
    for i in range(rows):
        prompt = int(torch.randint(3, 7, (1,), generator=gen))
        completion = int(torch.randint(2, length - prompt + 1, (1,), generator=gen))
        n = prompt + completion
        input_ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        attention[i, :n] = 1
        loss_mask[i, prompt:n] = 1
    advantages = torch.zeros(rows) if zero_advantages else torch.randn(rows, generator=gen)
    if not zero_advantages:
        advantages[0], advantages[-1] = abs(float(advantages[0])) + 0.5, -abs(float(advantages[-1])) - 0.5
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=torch.zeros(rows, length),
        advantages=advantages,
        policy_versions=torch.zeros(rows, dtype=torch.long),
        num_groups=1,
    )


def reference_model(model_dir: Path) -> Any:
    """The model as plain transformers loads it, in float32, without dropout."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is unannotated


def next_token_logprobs(model: Any, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """``[B, T]``: at position ``t`` the logprob of token ``t`` under ``log_softmax(logits /
    T)`` of a plain forward pass (the logits at ``t - 1`` predict token ``t``); 0 at
    position 0 and wherever the attention mask is 0 (what a trainer's ``logprobs`` gives)."""
    import torch

    attention = batch.attention_mask
    ids = torch.where(attention != 0, batch.input_ids, 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    out[:, 1:] = logp
    return torch.where(attention != 0, out, 0.0)


def reference_logprobs(model: Any, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """:func:`next_token_logprobs`, 0 also wherever the loss mask is 0 (the behaviour
    logprobs of a batch, which cover completion tokens only)."""
    import torch

    return torch.where(batch.loss_mask != 0, next_token_logprobs(model, batch, temperature), 0.0)


def on_policy(batch: TrainBatch, model: Any, temperature: float) -> TrainBatch:
    """``batch`` with behaviour logprobs from the reference model: as if the weights the
    trainer starts from had sampled it, so that the trainer's own logprobs must equal them."""
    return dataclasses.replace(batch, behaviour_logprobs=reference_logprobs(model, batch, temperature))


# ------------------------------------------------------------------------ weights


def snapshot(trainer: Trainer, version: int) -> dict[str, torch.Tensor] | None:
    """The exported weights, copied (None where the trainer returns None)."""
    exported = trainer.export_weights(version)
    if exported is None:
        return None
    return {name: t.detach().to("cpu", copy=True) for name, t in exported.tensors.items()}


def snapshot_one_rank(trainer: Trainer, version: int) -> dict[str, torch.Tensor]:
    """:func:`snapshot` of a trainer on one rank, which must export its weights."""
    weights = snapshot(trainer, version)
    assert weights is not None, "export_weights returned None on rank 0 of 1"
    return weights


def max_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between same-named tensors, and where."""
    worst, where = 0.0, ""
    for name, t in a.items():
        diff = float((t.double() - b[name].double()).abs().max()) if t.numel() else 0.0
        if diff != diff:  # NaN: treat as infinitely far
            diff = float("inf")
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def relative_step_difference(
    initial: Mapping[str, torch.Tensor], a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """How far step ``b`` landed from step ``a`` (both taken from ``initial``), relative to
    the size of step ``a``: ``|(b - initial) - (a - initial)| / |a - initial|`` over all
    weights, and the tensor that differs most. Adam's first step moves every weight by
    about the learning rate whatever its gradient, so a weight whose gradient is nearly 0
    (large terms cancelling, summed in another order on another number of ranks) may move
    differently; a norm over all weights weighs those few against the rest."""
    num = den = 0.0
    worst, where = 0.0, ""
    for name, t0 in initial.items():
        step_a = a[name].double() - t0.double()
        diff = b[name].double() - a[name].double()
        num += float((diff * diff).sum())
        den += float((step_a * step_a).sum())
        d = float(diff.abs().max()) if diff.numel() else 0.0
        if d > worst or not where:
            worst, where = d, name
    return (num**0.5 / den**0.5 if den > 0 else float("inf")), where


def compared_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics a resumed or re-run step must reproduce (timing left out)."""
    return {k: float(v) for k, v in metrics.items() if not k.startswith(TIMING_PREFIXES)}


# ------------------------------------------------------------------------ scenario


def rank_scenario(trainer: Trainer, model_dir: Path, checkpoint: Path, temperature: float) -> dict[str, Any]:
    """What the two-rank check compares, run alike on one rank and on each of two: a step
    on an on-policy batch of 5 rows (uneven over 2 ranks), the export, a checkpoint, a
    second step, then a load of the checkpoint and the second step again.

    Returns the metrics of the three steps, which exports returned weights, the weights
    before and after the first step (rank 0), and how far the step after the load landed
    from the step before it (rank 0)."""
    reference = reference_model(model_dir)
    first = on_policy(make_batch(model_dir, rows=5, seed=11), reference, temperature)
    second = on_policy(make_batch(model_dir, rows=5, seed=12), reference, temperature)
    del reference
    initial = snapshot(trainer, 0)
    metrics = [trainer.train_step(first)]
    after_first = snapshot(trainer, 1)
    trainer.save(checkpoint)
    metrics.append(trainer.train_step(second))
    after_second = snapshot(trainer, 2)
    trainer.load(checkpoint)
    metrics.append(trainer.train_step(second))
    again = snapshot(trainer, 3)
    exported = [w is not None for w in (after_first, after_second, again)]
    resume_diff = None
    if after_second is not None and again is not None:
        resume_diff = list(max_difference(after_second, again))
    return {
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
        "exported": exported,
        "initial": initial,
        "weights": after_first,
        "resume_diff": resume_diff,
    }


# ------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment a scheduler gives a trainer rank (as the local scheduler and srun
    do), with this process's import path, on loopback, one thread per rank."""
    import sys

    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def live_children(pid: int | None = None) -> set[tuple[int, str]]:
    """(pid, start time) of the processes whose parent is ``pid`` (this process) and that
    have not exited (zombies left out)."""
    pid = os.getpid() if pid is None else pid
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        state, parent, start = fields[0], int(fields[1]), fields[19]
        if parent == pid and state not in ("Z", "X"):
            out.add((int(entry), start))
    return out


def finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def moved_beyond_decay(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Tensors of ``after`` that are not ``c * before`` for one c in [0.9, 1] per tensor (what
    a zero gradient leaves under decoupled weight decay), with how far they are."""
    import torch

    moved = []
    for name, b in before.items():
        a = after[name]
        if torch.equal(a, b):
            continue
        b64, a64 = b.double(), a.double()
        norm = float((b64 * b64).sum())
        c = float((a64 * b64).sum()) / norm if norm > 0 else 1.0
        residual = float((a64 - c * b64).abs().max())
        if not (0.9 <= c <= 1.0 and residual <= 1e-6 * max(1.0, float(b64.abs().max()))):
            moved.append(f"{name} (by {float((a64 - b64).abs().max()):.3g})")
    return moved


def wait_process(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def beside_two_ranks(command: list[str], logs: Path, one_rank: Callable[[], T], timeout: float) -> T:
    """Start ``command`` as ranks 0 and 1 of a two-rank launch (each with the environment a
    scheduler gives it, :func:`rank_env`, and its output in ``logs/rank<r>.log``), run
    ``one_rank()`` meanwhile in this process, on one thread like each rank (another thread
    count sums in another order: ~1e-6 differences), then wait up to ``timeout`` seconds
    for the ranks. Returns what ``one_rank`` returned; a rank that fails or does not end
    in time fails the check with the end of its log."""
    import torch

    port = free_port()
    files = [open(logs / f"rank{r}.log", "w+") for r in range(2)]  # noqa: SIM115 - closed below
    ranks = [
        subprocess.Popen(command, env=rank_env(r, 2, port), stdout=files[r], stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            result = one_rank()
        finally:
            torch.set_num_threads(threads)
        codes = [wait_process(p, timeout) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    for r, code in enumerate(codes):
        # What the ranks wrote tells a crash at exit (results there) from one in the work.
        assert code == 0, (
            f"rank {r} of 2 failed (exit {code}; {logs} holds {sorted(p.name for p in logs.iterdir())}):\n"
            f"{(logs / f'rank{r}.log').read_text()[-4000:]}"
        )
    return result
