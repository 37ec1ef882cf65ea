"""The ``fsdp`` trainer: how batches are split over ranks, then on the tiny model: learning
signal, logprobs, the reference model, micro-batching and bf16 autocast. What it shares
with ``torchtitan`` (weight export, checkpoints, 2 gloo ranks against 1) is in
test_trainers.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing.trainer_support import next_token_logprobs, reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402

integration = pytest.mark.integration


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


def _completion_mean_logprob(logprobs: torch.Tensor, batch, row: int) -> float:
    mask = batch.loss_mask[row] != 0
    return float(logprobs[row][mask].mean())


@integration
def test_rewarded_completion_becomes_more_likely(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        batch = worker.make_batch(tiny_model_dir, rows=2, seed=1)
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
        batch = worker.make_batch(tiny_model_dir, rows=4, seed=2)
        ours = trainer.logprobs(batch)
    finally:
        trainer.close()
    reference = next_token_logprobs(reference_model(tiny_model_dir), batch, worker.TEMPERATURE)
    assert ours.shape == batch.input_ids.shape and ours.dtype == torch.float32
    attended = batch.attention_mask[:, 1:] != 0
    diff = worker.attended_diff(ours, reference, batch)
    assert diff < 1e-5, f"trainer logprobs differ from transformers' log_softmax(logits / T) by {diff}"
    assert (ours[:, 0] == 0).all() and (ours[:, 1:][~attended] == 0).all(), "position 0 and padding must be 0"


@integration
def test_reference_model_only_with_a_kl_term(tiny_model_dir: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plain = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, algorithm={"kl_coef": 0.0})
    try:
        assert plain.reference_model is None, "kl_coef = 0 must not load a reference model"
        metrics = plain.train_step(worker.on_policy(plain, worker.make_batch(tiny_model_dir, rows=2, seed=6)))
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
        batch = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=2, seed=6))
        first = trainer.train_step(batch)
        second = trainer.train_step(batch)
        ref_after = get_model_state_dict(ref, options=full)
    finally:
        trainer.close()
    assert first["kl/ref"] == pytest.approx(0.0, abs=1e-6), "policy and reference start equal"
    assert second["kl/ref"] > 1e-4 and second["loss/kl"] > 0, f"no KL after an update: {second}"
    assert worker.max_diff(dict(ref_after), ref_before)[0] == 0.0, "the reference model changed"


@integration
def test_micro_batch_size_does_not_change_the_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = []
    for micro in (1, 8):
        trainer = worker.make_trainer(
            tiny_model_dir, tmp_path, micro_batch_size=micro, algorithm={"loss_agg": "token_mean"}
        )
        try:
            batch = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=6, seed=7))
            metrics = [trainer.train_step(batch) for _ in range(2)]
            results.append((metrics, worker.weights(trainer)))
        finally:
            trainer.close()
    (m1, w1), (m8, w8) = results
    for a, b in zip(m1, m8):
        # grad_norm and loss are scale-sensitive (Adam's update is nearly scale-free).
        for key in ("loss", "grad_norm", "ratio/mean", "kl/approx", "logprob_gap/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), f"{key}: {a[key]} (1) vs {b[key]} (8)"
    diff, name = worker.max_diff(w1, w8)
    assert diff < 1e-5, f"micro-batches of 1 and of 8 update {name} differently by {diff}"


@integration
@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_auto_bf16_autocast_follows_the_hardware_and_sets_the_ratio(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """bf16 autocast pays off only where the device computes bf16 natively (1.9x faster
    with AMX, 3x slower without): "auto", the default, decides from the hardware. Under
    autocast the importance ratio is taken against the trainer's own logprobs (algorithm
    ratio "auto"): an fp32 sampler's logprobs, a few percent away, must not trip the clip."""
    from forgerl_plugins.trainers.fsdp.trainer import FSDPTrainer
    from forgerl_plugins.trainers.shared import base as trainer_base

    assert FSDPTrainer.Options().autocast_bf16 == "auto"
    monkeypatch.setattr(trainer_base, "native_bf16", lambda device: native)
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, autocast_bf16="auto")
    try:
        with trainer._autocast():
            product = torch.ones(4, 4) @ torch.ones(4, 4)
        batch = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=8))
        # A sampler whose logprobs are 0.5 nats below the trainer's: ratios of e^0.5 = 1.65.
        skewed = dataclasses.replace(batch, behaviour_logprobs=(batch.behaviour_logprobs - 0.5) * batch.loss_mask)
        metrics = trainer.train_step(skewed)
    finally:
        trainer.close()
    assert (product.dtype == torch.bfloat16) is native, product.dtype
    assert trainer.algorithm.ratio == ("old" if native else "behaviour")
    if native:
        assert metrics["ratio/mean"] == pytest.approx(1.0) and metrics["clip/high_frac"] == 0.0, metrics
    else:
        assert metrics["ratio/mean"] > 1.5 and metrics["clip/high_frac"] > 0, metrics


@integration
def test_bf16_autocast_tracks_fp32(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = worker.make_batch(tiny_model_dir, rows=3, seed=8)
    fp32 = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        expected = fp32.logprobs(batch)
    finally:
        fp32.close()
    bf16 = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, autocast_bf16=True)
    try:
        got = bf16.logprobs(batch)
        metrics = bf16.train_step(dataclasses.replace(batch, behaviour_logprobs=got * batch.loss_mask))
        weights = worker.weights(bf16)
    finally:
        bf16.close()
    attended = batch.attention_mask[:, 1:] != 0
    err = ((got - expected).abs() / (expected.abs() + 1))[:, 1:][attended].max().item()
    assert err < 0.02, f"bf16 autocast logprobs are {err:.3f} (relative) away from fp32"
    assert all(v.dtype == torch.float32 for v in weights.values()), "autocast must keep fp32 master weights"
    assert all(map(torch.isfinite, map(torch.tensor, metrics.values()))), metrics
