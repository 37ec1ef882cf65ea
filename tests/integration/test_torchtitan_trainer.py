"""The ``torchtitan`` trainer on the tiny models: the same logprobs, loss and update as
``fsdp`` on one rank (Qwen2, Llama, Qwen3), and what it refuses. What it shares with
``fsdp`` (Hugging Face weights in and out, checkpoints, 2 gloo ranks with FSDP or tensor
parallelism against fsdp on 1) is in test_trainers.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing.trainer_support import reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402

pytestmark = pytest.mark.integration

#: Per-token logprobs and weights: fp32, summed in another order by another model code.
TOL = 1e-5


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_torchtitan()


def test_forge_plugins_list_shows_it_available() -> None:
    from forgerl.registry.plugins import build_registry

    assert build_registry().get("trainer", "torchtitan").unavailable_reason() is None


# ----------------------------------------------------------------- cross-backend parity


@pytest.mark.parametrize("arch", ["qwen2-biased", "llama", "qwen3"])
def test_same_logprobs_loss_and_update_as_fsdp_on_one_rank(arch: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    fixture = {"qwen2-biased": "biased_model_dir", "llama": "llama_model_dir", "qwen3": "qwen3_model_dir"}[arch]
    model_dir = request.getfixturevalue(fixture)
    batch = worker.make_batch(model_dir, rows=4, seed=3)
    results = {}
    for kind in ("torchtitan", "fsdp"):
        trainer = worker.make_trainer(model_dir, tmp_path, 2, {"kl_coef": 0.05}, kind=kind)
        try:
            logprobs = trainer.logprobs(batch)
            # Both trainers step on the same batch (behaviour logprobs from fsdp's policy).
            stepped = worker.on_policy(trainer, batch) if kind == "fsdp" else None
            results[kind] = [trainer, logprobs, stepped]
        except BaseException:
            trainer.close()
            raise
    try:
        stepped = results["fsdp"][2]
        metrics = {kind: r[0].train_step(stepped) for kind, r in results.items()}
        weights = {kind: worker.weights(r[0], 1) for kind, r in results.items()}
    finally:
        for trainer, *_ in reversed(results.values()):  # the first one made the process group
            trainer.close()

    diff = worker.attended_diff(results["torchtitan"][1], results["fsdp"][1], batch)
    assert diff <= TOL, f"{arch}: torchtitan logprobs differ from fsdp's by {diff}"
    tt, fs = metrics["torchtitan"], metrics["fsdp"]
    assert tt.keys() == fs.keys(), sorted(tt.keys() ^ fs.keys())
    assert tt["loss"] == pytest.approx(fs["loss"], rel=1e-6, abs=1e-7), f"loss {tt['loss']} vs {fs['loss']}"
    for key in tt:
        assert tt[key] == pytest.approx(fs[key], rel=1e-4, abs=1e-5), f"{arch} {key}: {tt[key]} vs {fs[key]}"
    diff, name = worker.max_diff(weights["torchtitan"], weights["fsdp"])
    assert diff <= TOL, f"{arch}: after one step {name} differs between torchtitan and fsdp by {diff}"
    # AdamW's first step moves a weight by about lr (1e-4): 10x the tolerance.
    moved = worker.max_diff(weights["fsdp"], dict(reference_model(model_dir).state_dict()))[0]
    assert moved > 5 * TOL, f"the step hardly moved the weights ({moved}): the comparison proves nothing"


# ------------------------------------------------------------------------ refusals


def test_a_model_it_cannot_express_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    from forgerl_plugins.trainers.torchtitan.models import UnsupportedModel

    folder = tmp_path / "gelu"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(UnsupportedModel) as err:
        worker.make_trainer(folder, tmp_path, 2, kind="torchtitan")
    message = str(err.value)
    assert "\n" not in message and "hidden_act 'gelu_pytorch_tanh'" in message and str(folder) in message, message
    assert err.value.user_fixable, "a model it cannot express is the user's to change: exit status 2"
    assert not dist.is_initialized(), "a refused build must not leave its process group behind"


def test_left_padded_rows_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    import dataclasses

    batch = worker.make_batch(tiny_model_dir, rows=2, seed=7)
    left = dataclasses.replace(batch, attention_mask=batch.attention_mask.flip(-1))
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, 2, kind="torchtitan")
    try:
        with pytest.raises(ValueError, match="right-padded"):
            trainer.logprobs(left)
    finally:
        trainer.close()


def test_tensor_parallel_degree_must_fit_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import ConfigError

    # The tiny model has one key/value head; 1 rank cannot hold tp 2 either.
    with pytest.raises(ConfigError, match=r"dp_shard \(1\) \* tp \(2\) must equal the trainer's 1 ranks"):
        worker.make_trainer(tiny_model_dir, tmp_path, 2, kind="torchtitan", tp=2, dp_shard=1)


def test_smollm2_maps_onto_llama3(tmp_path: Path) -> None:
    """SmolLM2-135M's config (as converted by the smollm2-135m-instruct model backend)."""
    from forgerl_plugins.trainers.torchtitan.models import model_spec

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "vocab_size": 49152, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_spec(tmp_path)
    model = spec.model
    attention = model.layers[0].attention
    assert (spec.name, len(model.layers), model.dim, model.vocab_size) == ("llama3", 30, 576, 49152)
    assert (attention.n_heads, attention.n_kv_heads, attention.rope.theta) == (9, 3, 100000.0)
    assert attention.rope.scaling == "none" and attention.rope.dim == 64
    assert model.layers[0].feed_forward.w1.out_features == 1536
    assert model.enable_weight_tying and model.norm.eps == 1e-5
    assert type(attention.inner_attention).__qualname__ == "ScaledDotProductAttention.Config"
