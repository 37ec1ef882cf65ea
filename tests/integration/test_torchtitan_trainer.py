"""The ``torchtitan`` trainer on the tiny models: the same logprobs, loss and update as
``fsdp`` (cross-backend parity, on 1 rank and on 2 gloo ranks with FSDP or tensor
parallelism), Hugging Face weights in and out, checkpoints, and what it refuses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.helpers import fsdp_worker  # noqa: E402
from tests.helpers import torchtitan_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

pytestmark = pytest.mark.integration

WORKER = Path(worker.__file__)
#: Per-token logprobs and weights: fp32, summed in another order by another model code.
TOL = 1e-5


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_torchtitan()


def _with_random_biases(source: Path, folder: Path) -> Path:
    """``source``'s model with random q/k/v biases (the tiny Qwen2's own are zero): the
    q/k bias permutation between Hugging Face's and TorchTitan's RoPE layouts, and the
    biases' tensor-parallel sharding, show only with biases that are not."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, folder, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(folder)
    return folder


def _tiny(tmp_path_factory: pytest.TempPathFactory, **options) -> Path:
    from forgerl_plugins.models import TinyModelOptions
    from forgerl_plugins.models.tiny import build_tiny_model

    return build_tiny_model(TinyModelOptions(**options), cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def biased_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_random_biases(tiny_model_dir, tmp_path_factory.mktemp("biased"))


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, architecture="llama")


@pytest.fixture(scope="module")
def qwen3_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (q/k norms, explicit head_dim) with the tiny model's tokenizer;
    its norm weights are perturbed so that the q/k norms do something."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    config = Qwen3Config(
        vocab_size=tiny["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.1, generator=gen)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 heads over 2 key/value heads, with biases: what tensor parallelism over 2 ranks splits."""
    return _with_random_biases(_tiny(tmp_path_factory, hidden_size=128), tmp_path_factory.mktemp("wide"))


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys(), f"different names: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)


def _attended_diff(a: torch.Tensor, b: torch.Tensor, batch) -> float:
    attended = batch.attention_mask[:, 1:] != 0
    return (a[:, 1:] - b[:, 1:]).abs()[attended].max().item()


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batch(model_dir: Path, rows: int, seed: int):
    config = json.loads((model_dir / "config.json").read_text())
    return fsdp_worker.make_batch(rows, config["vocab_size"], config["pad_token_id"], seed=seed)


def test_forge_plugins_list_shows_it_available() -> None:
    from forgerl.plugins import build_registry

    assert build_registry().get("trainer", "torchtitan").unavailable_reason() is None


# ----------------------------------------------------------------- cross-backend parity


@pytest.mark.parametrize("arch", ["qwen2-biased", "llama", "qwen3"])
def test_same_logprobs_loss_and_update_as_fsdp_on_one_rank(arch: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    fixture = {"qwen2-biased": "biased_model_dir", "llama": "llama_model_dir", "qwen3": "qwen3_model_dir"}[arch]
    model_dir = request.getfixturevalue(fixture)
    batch = _batch(model_dir, rows=4, seed=3)
    results = {}
    for kind in ("torchtitan", "fsdp"):
        trainer = worker.make_trainer(kind, model_dir, tmp_path, 2, {"kl_coef": 0.05})
        try:
            logprobs = trainer.logprobs(batch)
            # Both trainers step on the same batch (behaviour logprobs from fsdp's policy).
            stepped = fsdp_worker.on_policy(trainer, batch) if kind == "fsdp" else None
            results[kind] = [trainer, logprobs, stepped]
        except BaseException:
            trainer.close()
            raise
    try:
        stepped = results["fsdp"][2]
        metrics = {kind: r[0].train_step(stepped) for kind, r in results.items()}
        weights = {kind: {k: v.clone() for k, v in r[0].export_weights(1).tensors.items()} for kind, r in results.items()}
    finally:
        for trainer, *_ in reversed(results.values()):  # the first one made the process group
            trainer.close()

    diff = _attended_diff(results["torchtitan"][1], results["fsdp"][1], batch)
    assert diff <= TOL, f"{arch}: torchtitan logprobs differ from fsdp's by {diff}"
    tt, fs = metrics["torchtitan"], metrics["fsdp"]
    assert tt.keys() == fs.keys(), sorted(tt.keys() ^ fs.keys())
    assert tt["loss"] == pytest.approx(fs["loss"], rel=1e-6, abs=1e-7), f"loss {tt['loss']} vs {fs['loss']}"
    for key in tt:
        assert tt[key] == pytest.approx(fs[key], rel=1e-4, abs=1e-5), f"{arch} {key}: {tt[key]} vs {fs[key]}"
    diff, name = _max_diff(weights["torchtitan"], weights["fsdp"])
    assert diff <= TOL, f"{arch}: after one step {name} differs between torchtitan and fsdp by {diff}"
    # AdamW's first step moves a weight by about lr (1e-4): 10x the tolerance.
    moved = _max_diff(weights["fsdp"], dict(_hf_model(model_dir).state_dict()))[0]
    assert moved > 5 * TOL, f"the step hardly moved the weights ({moved}): the comparison proves nothing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_ranks_match_fsdp_on_one_rank(biased_model_dir: Path, wide_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models = {"biased": biased_model_dir, "wide": wide_model_dir}
    out = tmp_path / "two_ranks"
    out.mkdir()
    args = [sys.executable, str(WORKER), "--out", str(out)]
    for key, path in models.items():
        args += ["--model", f"{key}={path}"]
    for name in worker.SCENARIOS:
        args += ["--scenario", name]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
                  "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(args, env={**os.environ, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    try:
        # fsdp on one rank meanwhile, in this process, on one thread like each rank.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        one_rank = {}
        try:
            for name, (key, *_) in worker.SCENARIOS.items():
                trainer, logprobs, metrics, weights = worker.run_scenario("fsdp", name, models[key], tmp_path)
                trainer.close()
                one_rank[name] = (logprobs, metrics, dict(weights.tensors))
        finally:
            torch.set_num_threads(threads)
        logs = [proc.communicate(timeout=scaled(300))[0] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for r, (proc, log) in enumerate(zip(ranks, logs)):
        assert proc.returncode == 0, f"rank {r} of 2 failed ({proc.returncode}):\n{log[-4000:]}"

    for name, (logprobs, metrics, weights) in one_rank.items():
        key = worker.SCENARIOS[name][0]
        batch = _batch(models[key], worker.SCENARIOS[name][1], seed=len(name))
        two_logprobs = load_file(out / f"{name}.logprobs.safetensors")["logprobs"]
        diff = _attended_diff(two_logprobs, logprobs, batch)
        assert diff <= TOL, f"{name}: torchtitan on 2 ranks gives logprobs {diff} from fsdp's on 1"
        two_metrics = json.loads((out / f"{name}.json").read_text())
        for step, (a, b) in enumerate(zip(metrics, two_metrics)):
            assert a.keys() == b.keys(), f"{name} step {step}: keys differ {sorted(a.keys() ^ b.keys())}"
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), f"{name} step {step} loss"
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-4), f"{name} step {step} {k}: {a[k]} vs {b[k]}"
        diff, param = _max_diff(weights, load_file(out / f"{name}.safetensors"))
        assert diff <= TOL, f"{name}: {param} differs by {diff} between torchtitan on 2 ranks and fsdp on 1"


# ------------------------------------------------------------------ weights in and out


def test_exported_weights_are_hugging_face_weights(biased_model_dir: Path, tmp_path: Path) -> None:
    original = _hf_model(biased_model_dir).state_dict()
    trainer = worker.make_trainer("torchtitan", biased_model_dir, tmp_path, 4, {})
    try:
        exported = trainer.export_weights(7)
        assert exported is not None and exported.version == 7
        initial = dict(exported.tensors)
        assert sorted(initial) == sorted(original), f"names differ: {sorted(initial.keys() ^ original.keys())}"
        for name, tensor in original.items():
            assert initial[name].dtype == tensor.dtype, f"{name}: {initial[name].dtype} != {tensor.dtype}"
            assert torch.equal(initial[name], tensor), f"{name} does not round-trip exactly"
        batch = fsdp_worker.on_policy(trainer, _batch(biased_model_dir, rows=4, seed=4))
        trainer.train_step(batch)
        stepped = {k: v.clone() for k, v in trainer.export_weights(8).tensors.items()}
        trainer_logprobs = trainer.logprobs(batch)
    finally:
        trainer.close()
    changed = [k for k in stepped if not torch.equal(stepped[k], original[k])]
    assert "model.layers.0.self_attn.q_proj.bias" in changed and len(changed) >= len(stepped) // 2, changed
    # What a generator would load: a plain transformers model with the exported weights
    # gives the trainer's own logprobs (a q/k permutation error would not).
    loaded = _hf_model(biased_model_dir)
    loaded.load_state_dict(stepped, strict=True)
    with torch.no_grad():
        logits = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1] / fsdp_worker.TEMPERATURE, dim=-1)
    hf_logprobs = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    attended = batch.attention_mask[:, 1:] != 0
    diff = (hf_logprobs - trainer_logprobs[:, 1:]).abs()[attended].max().item()
    assert diff <= TOL, f"exported weights give logprobs {diff} away from the trainer's"


# ------------------------------------------------------------------------ checkpoints


def test_checkpoint_resumes_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    def weights(trainer) -> dict:
        return {k: v.clone() for k, v in trainer.export_weights(0).tensors.items()}

    batch1 = _batch(tiny_model_dir, rows=3, seed=5)
    batch2 = _batch(tiny_model_dir, rows=3, seed=6)
    trainer = worker.make_trainer("torchtitan", tiny_model_dir, tmp_path, 2, {})
    try:
        batch1, batch2 = (fsdp_worker.on_policy(trainer, b) for b in (batch1, batch2))
        trainer.train_step(batch1)
        trainer.save(tmp_path / "ckpt")
        expected_metrics = trainer.train_step(batch2)
        expected_weights = weights(trainer)
        trainer.train_step(batch1)  # move on, then roll back
        trainer.load(tmp_path / "ckpt")
        assert trainer.train_step(batch2) == expected_metrics
        assert _max_diff(weights(trainer), expected_weights)[0] == 0.0, "load in the same trainer is not exact"
    finally:
        trainer.close()

    resumed = worker.make_trainer("torchtitan", tiny_model_dir, tmp_path, 2, {})
    try:
        resumed.load(tmp_path / "ckpt")
        assert resumed.train_step(batch2) == expected_metrics
        diff, name = _max_diff(weights(resumed), expected_weights)
    finally:
        resumed.close()
    assert diff == 0.0, f"a fresh trainer resumed from the checkpoint differs at {name} by {diff}"


def test_checkpoint_load_refuses_a_folder_without_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import CheckpointUnusable

    trainer = worker.make_trainer("torchtitan", tiny_model_dir, tmp_path, 2, {})
    try:
        with pytest.raises(CheckpointUnusable, match="not a trainer checkpoint"):
            trainer.load(tmp_path)
    finally:
        trainer.close()


# ------------------------------------------------------------------------ refusals


def test_a_model_it_cannot_express_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    from forgerl_plugins.trainers.torchtitan.models import UnsupportedModel

    folder = tmp_path / "gelu"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(UnsupportedModel) as err:
        worker.make_trainer("torchtitan", folder, tmp_path, 2, {})
    message = str(err.value)
    assert "\n" not in message and "hidden_act 'gelu_pytorch_tanh'" in message and str(folder) in message, message
    assert err.value.user_fixable, "a model it cannot express is the user's to change: exit status 2"
    assert not dist.is_initialized(), "a refused build must not leave its process group behind"


def test_left_padded_rows_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    import dataclasses

    batch = _batch(tiny_model_dir, rows=2, seed=7)
    left = dataclasses.replace(batch, attention_mask=batch.attention_mask.flip(-1))
    trainer = worker.make_trainer("torchtitan", tiny_model_dir, tmp_path, 2, {})
    try:
        with pytest.raises(ValueError, match="right-padded"):
            trainer.logprobs(left)
    finally:
        trainer.close()


def test_tensor_parallel_degree_must_fit_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import ConfigError

    # The tiny model has one key/value head; 1 rank cannot hold tp 2 either.
    with pytest.raises(ConfigError, match=r"dp_shard \(1\) \* tp \(2\) must equal the trainer's 1 ranks"):
        worker.make_trainer("torchtitan", tiny_model_dir, tmp_path, 2, {}, tp=2, dp_shard=1)


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
