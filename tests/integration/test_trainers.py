"""What the ``fsdp`` and ``torchtitan`` trainers both do, each test run with each:
Hugging Face weights in and out, checkpoints that resume exactly, a folder without a
checkpoint refused, and 2 gloo ranks taking the step ``fsdp`` takes on 1. What only one of
them does is in test_fsdp_trainer.py and test_torchtitan_trainer.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing.trainer_support import beside_two_ranks, next_token_logprobs, reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = pytest.mark.integration

#: Per-token logprobs and weights: fp32, summed in another order (by other model code, or
#: over 2 ranks).
TOL = 1e-5


@pytest.fixture(params=worker.TRAINERS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "torchtitan":
        require_torchtitan()
    return request.param


def test_exported_weights_are_hugging_face_weights(kind: str, biased_model_dir: Path, tmp_path: Path) -> None:
    original = reference_model(biased_model_dir).state_dict()
    trainer = worker.make_trainer(biased_model_dir, tmp_path, 4, kind=kind)
    try:
        exported = trainer.export_weights(7)
        assert exported is not None and exported.version == 7
        initial = dict(exported.tensors)
        assert sorted(initial) == sorted(original), f"names differ: {sorted(initial.keys() ^ original.keys())}"
        assert initial["lm_head.weight"].data_ptr() == initial["model.embed_tokens.weight"].data_ptr(), (
            "the tied embedding is exported as two copies, which a transport then sends twice"
        )
        for name, tensor in original.items():
            assert initial[name].dtype == tensor.dtype, f"{name}: {initial[name].dtype} != {tensor.dtype}"
            assert torch.equal(initial[name], tensor), f"{name} does not round-trip exactly"
        batch = worker.on_policy(trainer, worker.make_batch(biased_model_dir, rows=4, seed=3))
        trainer.train_step(batch)
        stepped = worker.weights(trainer, 8)
        trainer_logprobs = trainer.logprobs(batch)
    finally:
        trainer.close()
    changed = [k for k in stepped if not torch.equal(stepped[k], original[k])]
    assert len(changed) >= len(stepped) // 2, f"only {changed} changed after a step"
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert name in changed, f"{name} did not change after a step"
    assert torch.equal(stepped["lm_head.weight"], stepped["model.embed_tokens.weight"]), "tied weights diverged"
    # What a generator would load: a plain transformers model with the exported weights
    # gives the trainer's own logprobs (a q/k bias permutation error would not).
    loaded = reference_model(biased_model_dir)
    loaded.load_state_dict(stepped, strict=True)
    assert worker.max_diff(dict(loaded.state_dict()), stepped)[0] == 0.0, "the exported weights do not load back exactly"
    diff = worker.attended_diff(next_token_logprobs(loaded, batch, worker.TEMPERATURE), trainer_logprobs, batch)
    assert diff <= TOL, f"exported weights give logprobs {diff} away from the trainer's"


def test_checkpoint_resumes_identically(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, 2, kind=kind)
    try:
        batch1 = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=4))
        batch2 = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=5))
        trainer.train_step(batch1)
        trainer.save(tmp_path / "ckpt")
        expected_metrics = trainer.train_step(batch2)
        expected_weights = worker.weights(trainer)
        trainer.train_step(batch1)  # move on, then roll back
        trainer.load(tmp_path / "ckpt")
        assert trainer.train_step(batch2) == expected_metrics
        assert worker.max_diff(worker.weights(trainer), expected_weights)[0] == 0.0, (
            "load in the same trainer is not exact"
        )
    finally:
        trainer.close()

    resumed = worker.make_trainer(tiny_model_dir, tmp_path, 2, kind=kind)
    try:
        resumed.load(tmp_path / "ckpt")
        assert resumed.train_step(batch2) == expected_metrics
        diff, name = worker.max_diff(worker.weights(resumed), expected_weights)
    finally:
        resumed.close()
    assert diff == 0.0, f"a fresh trainer resumed from the checkpoint differs at {name} by {diff}"


def test_checkpoint_load_refuses_a_folder_without_one(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import CheckpointUnusable

    trainer = worker.make_trainer(tiny_model_dir, tmp_path, 2, kind=kind)
    try:
        with pytest.raises(CheckpointUnusable, match="not a trainer checkpoint"):
            trainer.load(tmp_path)
    finally:
        trainer.close()


@pytest.mark.slow
def test_two_gloo_ranks_match_fsdp_on_one_rank(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``kind`` on 2 ranks (each scenario of its own: uneven rows, a rank without rows,
    tensor parallelism) against ``fsdp`` on 1: logprobs, metrics and the update agree."""
    from safetensors.torch import load_file

    names = [name for name, s in worker.SCENARIOS.items() if kind in s.trainers]
    models = {s.model: request.getfixturevalue(f"{s.model}_model_dir") for s in map(worker.SCENARIOS.get, names)}
    out = tmp_path / "two_ranks"
    out.mkdir()
    command = [sys.executable, worker.__file__, "--trainer", kind, "--out", str(out)]
    command += [arg for key, path in models.items() for arg in ("--model", f"{key}={path}")]
    command += [arg for name in names for arg in ("--scenario", name)]

    def fsdp_on_one_rank() -> dict:
        results = {}
        for name in names:
            trainer, logprobs, metrics, weights = worker.run_scenario(
                "fsdp", name, models[worker.SCENARIOS[name].model], tmp_path
            )
            trainer.close()
            results[name] = (logprobs, metrics, dict(weights.tensors))
        return results

    one_rank = beside_two_ranks(command, out, fsdp_on_one_rank, scaled(300))
    for name, (logprobs, metrics, weights) in one_rank.items():
        scenario = worker.SCENARIOS[name]
        batch = worker.make_batch(models[scenario.model], scenario.rows, seed=len(name))
        two_logprobs = load_file(out / f"{name}.logprobs.safetensors")["logprobs"]
        diff = worker.attended_diff(two_logprobs, logprobs, batch)
        assert diff <= TOL, f"{name}: {kind} on 2 ranks gives logprobs {diff} from fsdp's on 1"
        two_metrics = json.loads((out / f"{name}.json").read_text())
        assert len(two_metrics) == len(metrics) == scenario.steps, name
        for step, (a, b) in enumerate(zip(metrics, two_metrics)):
            assert a.keys() == b.keys(), f"{name} step {step}: keys differ {sorted(a.keys() ^ b.keys())}"
            # The batch carries token versions (worker.with_token_versions): the gap by age is
            # reduced over micro-batches and ranks like every other metric.
            assert "logprob_gap/age_0" in a, f"{name} step {step}: no logprob gap by version age"
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), f"{name} step {step} loss"
            for k in a:
                # Logprobs here are around -30 (random tokens): fp32 rounding, summed in
                # another order on 2 ranks, moves the logprob-gap metrics by up to ~1e-5.
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-4), f"{name} step {step} {k}: {a[k]} vs {b[k]}"
        diff, param = worker.max_diff(weights, load_file(out / f"{name}.safetensors"))
        assert diff <= TOL, f"{name}: {param} differs by {diff} between {kind} on 2 ranks and fsdp on 1"
