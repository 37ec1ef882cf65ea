"""The ``fsdp`` trainer: how batches are split over ranks, then on the tiny model: learning
signal, logprobs, weight export, checkpoints, the reference model, micro-batching, bf16
autocast, and 2 gloo ranks against 1."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.helpers import fsdp_worker as worker  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

integration = pytest.mark.integration

WORKER = Path(worker.__file__)


# ------------------------------------------------------------ batching (no processes)


def test_rows_are_split_contiguously_and_completely() -> None:
    from forgerl_plugins.trainers.shared.batching import rank_rows

    for size in range(0, 9):
        for world in range(1, 5):
            shares = [rank_rows(size, world, r) for r in range(world)]
            assert [i for share in shares for i in share] == list(range(size)), (size, world, shares)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1, (size, world, shares)


def test_every_rank_runs_the_same_number_of_micro_batches() -> None:
    from forgerl_plugins.trainers.shared.batching import micro_batches

    # 5 rows, 2 ranks, micro-batches of 2: rank 0 has 3 rows (2 + 1), rank 1 has 2 (2 + padding).
    assert [mb.rows for mb in micro_batches(5, 2, 0, 2)] == [[0, 1], [2]]
    assert [(mb.rows, mb.padding) for mb in micro_batches(5, 2, 1, 2)] == [([3, 4], False), ([0], True)]
    # 1 row, 2 ranks: rank 1 has nothing but still runs one (padding) micro-batch.
    assert [(mb.rows, mb.padding) for mb in micro_batches(1, 2, 1, 4)] == [([0], True)]
    for size, world, micro in [(7, 3, 2), (2, 4, 1), (16, 2, 3)]:
        counts = {len(micro_batches(size, world, r, micro)) for r in range(world)}
        assert len(counts) == 1, f"B={size} W={world} mbs={micro}: micro-batch counts {counts}"


def test_global_count_matches_the_loss_aggregation() -> None:
    from forgerl_plugins.trainers.shared.batching import global_count

    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]])
    assert global_count(mask, "token_mean") == 4.0
    for mode in ("seq_mean_token_mean", "seq_mean_token_sum", "constant_norm"):
        assert global_count(mask, mode) == 2.0, mode  # the all-masked row is no sequence
    assert global_count(torch.zeros(2, 3), "token_mean") == 1.0, "an empty mask must not divide by 0"


# ------------------------------------------------------------- trainer (tiny model)


def _vocab_and_pad(model_dir: Path) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return config["vocab_size"], config["pad_token_id"]


def _batch(model_dir: Path, rows: int, seed: int = 0):
    vocab, pad = _vocab_and_pad(model_dir)
    return worker.make_batch(rows, vocab, pad, seed=seed)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each next token with plain transformers, [B, T-1]."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _weights(trainer) -> dict[str, torch.Tensor]:
    exported = trainer.export_weights(0)
    assert exported is not None, "a single rank is rank 0 and must get the weights"
    return {k: v.clone() for k, v in exported.tensors.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), f"different names: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


def _completion_mean_logprob(logprobs: torch.Tensor, batch, row: int) -> float:
    mask = batch.loss_mask[row] != 0
    return float(logprobs[row][mask].mean())


@integration
def test_rewarded_completion_becomes_more_likely(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        batch = _batch(tiny_model_dir, rows=2, seed=1)
        # Two completions: the first rewarded, the second penalised.
        batch = dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0]))
        batch = worker.on_policy(trainer, batch)
        before = trainer.logprobs(batch)
        for _ in range(3):
            metrics = trainer.train_step(batch)
        after = trainer.logprobs(batch)
    finally:
        trainer.close()
    good_before, good_after = (_completion_mean_logprob(lp, batch, 0) for lp in (before, after))
    bad_before, bad_after = (_completion_mean_logprob(lp, batch, 1) for lp in (before, after))
    assert good_after > good_before + 0.01, f"rewarded completion: mean logprob {good_before} -> {good_after}"
    assert bad_after < bad_before - 0.01, f"penalised completion: mean logprob {bad_before} -> {bad_after}"
    for key in ("loss", "grad_norm", "lr", "train/tokens", "loss/policy", "ratio/mean", "clip/high_frac"):
        assert key in metrics, f"{key} missing from {sorted(metrics)}"
    assert metrics["train/tokens"] == float((batch.loss_mask[:, 1:] != 0).sum())


@integration
def test_logprobs_match_a_plain_transformers_forward(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 4 rows in micro-batches of 3: the second micro-batch is cut to its own length.
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=3)
    try:
        batch = _batch(tiny_model_dir, rows=4, seed=2)
        ours = trainer.logprobs(batch)
    finally:
        trainer.close()
    reference = _hf_logprobs(_hf_model(tiny_model_dir), batch, worker.TEMPERATURE)
    assert ours.shape == batch.input_ids.shape and ours.dtype == torch.float32
    attended = batch.attention_mask[:, 1:] != 0
    diff = (ours[:, 1:] - reference).abs()[attended].max().item()
    assert diff < 1e-5, f"trainer logprobs differ from transformers' log_softmax(logits / T) by {diff}"
    assert (ours[:, 0] == 0).all() and (ours[:, 1:][~attended] == 0).all(), "position 0 and padding must be 0"


@integration
def test_exported_weights_are_hugging_face_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    original = _hf_model(tiny_model_dir).state_dict()
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=4)
    try:
        exported = trainer.export_weights(7)
        assert exported is not None and exported.version == 7
        initial = dict(exported.tensors)
        assert sorted(initial) == sorted(original), f"names differ: {sorted(initial.keys() ^ original.keys())}"
        for name, tensor in original.items():
            assert initial[name].dtype == tensor.dtype, f"{name}: {initial[name].dtype} != {tensor.dtype}"
            assert torch.equal(initial[name], tensor), f"{name} differs from the checkpoint"

        batch = worker.on_policy(trainer, _batch(tiny_model_dir, rows=4, seed=3))
        trainer.train_step(batch)
        stepped = _weights(trainer)
        trainer_logprobs = trainer.logprobs(batch)
    finally:
        trainer.close()
    changed = [k for k in stepped if not torch.equal(stepped[k], original[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) >= len(stepped) // 2, (
        f"only {changed} changed after a step"
    )
    assert torch.equal(stepped["lm_head.weight"], stepped["model.embed_tokens.weight"]), "tied weights diverged"
    # What a generator would load: the exported weights in a plain transformers model give
    # the trainer's own logprobs.
    loaded = _hf_model(tiny_model_dir)
    loaded.load_state_dict(stepped, strict=True)
    assert _max_diff(dict(loaded.state_dict()), stepped)[0] == 0.0, "the exported weights do not load back exactly"
    attended = batch.attention_mask[:, 1:] != 0
    diff = (_hf_logprobs(loaded, batch, worker.TEMPERATURE) - trainer_logprobs[:, 1:]).abs()[attended].max().item()
    assert diff < 1e-5, f"exported weights give logprobs {diff} away from the trainer's"


@integration
def test_checkpoint_resumes_bit_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        batch1 = worker.on_policy(trainer, _batch(tiny_model_dir, rows=3, seed=4))
        batch2 = worker.on_policy(trainer, _batch(tiny_model_dir, rows=3, seed=5))
        trainer.train_step(batch1)
        trainer.save(tmp_path / "ckpt")
        expected_metrics = trainer.train_step(batch2)
        expected_weights = _weights(trainer)
        trainer.train_step(batch1)  # move on, then roll back
        trainer.load(tmp_path / "ckpt")
        again_metrics = trainer.train_step(batch2)
        again_weights = _weights(trainer)
    finally:
        trainer.close()
    assert again_metrics == expected_metrics
    assert _max_diff(again_weights, expected_weights)[0] == 0.0, "load in the same trainer is not exact"

    resumed = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        resumed.load(tmp_path / "ckpt")
        resumed_metrics = resumed.train_step(batch2)
        resumed_weights = _weights(resumed)
    finally:
        resumed.close()
    assert resumed_metrics == expected_metrics
    diff, name = _max_diff(resumed_weights, expected_weights)
    assert diff == 0.0, f"a fresh trainer resumed from the checkpoint differs at {name} by {diff}"


@integration
def test_checkpoint_load_refuses_a_folder_without_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import CheckpointError

    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
            trainer.load(tmp_path)
    finally:
        trainer.close()


@integration
def test_reference_model_only_with_a_kl_term(tiny_model_dir: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plain = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, algorithm={"kl_coef": 0.0})
    try:
        assert plain.reference_model is None, "kl_coef = 0 must not load a reference model"
        metrics = plain.train_step(worker.on_policy(plain, _batch(tiny_model_dir, rows=2, seed=6)))
        assert "kl/ref" not in metrics and metrics["loss/kl"] == 0.0, metrics
    finally:
        plain.close()

    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, algorithm={"kl_coef": 0.1})
    try:
        ref = trainer.reference_model
        assert ref is not None, "kl_coef > 0 needs a reference model"
        assert not any(p.requires_grad for p in ref.parameters()), "the reference model must be frozen"
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        ref_before = {k: v.clone() for k, v in get_model_state_dict(ref, options=full).items()}
        batch = worker.on_policy(trainer, _batch(tiny_model_dir, rows=2, seed=6))
        first = trainer.train_step(batch)
        second = trainer.train_step(batch)
        ref_after = get_model_state_dict(ref, options=full)
    finally:
        trainer.close()
    assert first["kl/ref"] == pytest.approx(0.0, abs=1e-6), "policy and reference start equal"
    assert second["kl/ref"] > 1e-4 and second["loss/kl"] > 0, f"no KL after an update: {second}"
    assert _max_diff(dict(ref_after), ref_before)[0] == 0.0, "the reference model changed"


@integration
def test_micro_batch_size_does_not_change_the_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = []
    for micro in (1, 8):
        trainer = worker.make_trainer(
            tiny_model_dir, tmp_path, micro_batch_size=micro, algorithm={"loss_agg": "token_mean"}
        )
        try:
            batch = worker.on_policy(trainer, _batch(tiny_model_dir, rows=6, seed=7))
            metrics = [trainer.train_step(batch) for _ in range(2)]
            results.append((metrics, _weights(trainer)))
        finally:
            trainer.close()
    (m1, w1), (m8, w8) = results
    for a, b in zip(m1, m8):
        # grad_norm and loss are scale-sensitive (Adam's update is nearly scale-free).
        for key in ("loss", "grad_norm", "ratio/mean", "kl/approx", "logprob_gap/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), f"{key}: {a[key]} (1) vs {b[key]} (8)"
    diff, name = _max_diff(w1, w8)
    assert diff < 1e-5, f"micro-batches of 1 and of 8 update {name} differently by {diff}"


@integration
@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_auto_bf16_autocast_follows_the_hardware(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """bf16 autocast pays off only where the device computes bf16 natively (1.9x faster
    with AMX, 3x slower without): "auto" decides from the hardware. The default is off."""
    from forgerl_plugins.trainers.fsdp import FSDPTrainerOptions
    from forgerl_plugins.trainers.shared import base as trainer_base

    assert FSDPTrainerOptions().autocast_bf16 is False
    monkeypatch.setattr(trainer_base, "native_bf16", lambda device: native)
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, autocast_bf16="auto")
    try:
        with trainer._autocast():
            product = torch.ones(4, 4) @ torch.ones(4, 4)
    finally:
        trainer.close()
    assert (product.dtype == torch.bfloat16) is native, product.dtype


@integration
def test_bf16_autocast_tracks_fp32(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = _batch(tiny_model_dir, rows=3, seed=8)
    fp32 = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        expected = fp32.logprobs(batch)
    finally:
        fp32.close()
    bf16 = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, autocast_bf16=True)
    try:
        got = bf16.logprobs(batch)
        metrics = bf16.train_step(dataclasses.replace(batch, behaviour_logprobs=got * batch.loss_mask))
        weights = _weights(bf16)
    finally:
        bf16.close()
    attended = batch.attention_mask[:, 1:] != 0
    err = ((got - expected).abs() / (expected.abs() + 1))[:, 1:][attended].max().item()
    assert err < 0.02, f"bf16 autocast logprobs are {err:.3f} (relative) away from fp32"
    assert all(v.dtype == torch.float32 for v in weights.values()), "autocast must keep fp32 master weights"
    assert all(map(torch.isfinite, map(torch.tensor, metrics.values()))), metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@integration
@pytest.mark.slow
def test_two_gloo_ranks_match_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "two_ranks"
    out.mkdir()
    args = [sys.executable, str(WORKER), "--model", str(tiny_model_dir), "--out", str(out)]
    for name in worker.SCENARIOS:
        args += ["--scenario", name]
    # The environment torchrun, srun and the local scheduler give each rank (starting the
    # ranks directly spares a third process importing torch on a 2-core machine).
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
                  "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(args, env={**os.environ, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    try:
        # The one-rank runs go meanwhile, in this process, on one thread like each rank
        # (another thread count sums in another order: ~1e-6 differences).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        one_rank = {}
        try:
            for name in worker.SCENARIOS:
                trainer, metrics, weights = worker.run_scenario(name, tiny_model_dir, tmp_path)
                trainer.close()
                one_rank[name] = (metrics, dict(weights.tensors))
        finally:
            torch.set_num_threads(threads)
        logs = [proc.communicate(timeout=scaled(150))[0] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for r, (proc, log) in enumerate(zip(ranks, logs)):
        assert proc.returncode == 0, f"rank {r} of 2 failed ({proc.returncode}):\n{log[-4000:]}"

    for name, (metrics, weights) in one_rank.items():
        two_metrics = json.loads((out / f"{name}.json").read_text())
        two_weights = load_file(out / f"{name}.safetensors")
        for step, (a, b) in enumerate(zip(metrics, two_metrics)):
            assert a.keys() == b.keys(), f"{name} step {step}: keys differ {sorted(a.keys() ^ b.keys())}"
            for key in a:
                # Logprobs here are around -30 (random tokens): fp32 rounding, summed in
                # another order on 2 ranks, moves the logprob-gap metrics by up to ~1e-5.
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-4), (
                    f"{name} step {step} {key}: 1 rank {a[key]} vs 2 ranks {b[key]}"
                )
        diff, param = _max_diff(weights, two_weights)
        assert diff < 1e-5, f"{name}: {param} differs by {diff} between 1 and 2 ranks"
