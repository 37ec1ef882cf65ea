"""The ``fsdp`` and ``torchtitan`` trainers with a LoRA adapter (``trainer.options.lora``)
on the tiny model, each test with each: only the adapter trains, the KL reference is the
base model, checkpoints hold the adapter and resume exactly, and the exported adapter is
one PEFT (and so vLLM) loads. The two trainers export the same adapter and make the same
update from the same seed. Two gloo ranks against one: the ``lora`` scenario of
test_trainers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from forgerl.testing.trainer_support import next_token_logprobs, reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402

pytestmark = pytest.mark.integration

LORA = {"rank": 4, "alpha": 8}
TOL = 1e-5


@pytest.fixture(params=worker.TRAINERS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "torchtitan":
        require_torchtitan()
    return request.param


def _lora_trainer(model_dir: Path, run_dir: Path, kind: str, kl_coef: float = 0.0, options: dict | None = None, **lora):
    return worker.make_trainer(
        model_dir, run_dir, 2, algorithm={"kl_coef": kl_coef}, kind=kind, lora={**LORA, **lora}, **(options or {})
    )


def _stepped(trainer, model_dir: Path, steps: int = 2):
    batch = worker.on_policy(trainer, worker.make_batch(model_dir, rows=3, seed=4))
    for _ in range(steps):
        trainer.train_step(batch)
    return batch


def test_only_the_adapter_trains_and_has_optimizer_state(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _lora_trainer(tiny_model_dir, tmp_path, kind)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        _stepped(trainer, tiny_model_dir)
        after = dict(trainer.model.named_parameters())
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        state_of = {n for n, p in trainer.model.named_parameters() if trainer.optimizer.state.get(p)}
    finally:
        trainer.close()
    # 2 layers x 7 projections x (A, B) of the tiny Qwen2.
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)
    assert changed == trainable, f"changed but frozen: {sorted(changed - trainable)}; unchanged: {sorted(trainable - changed)}"
    assert state_of == trainable, f"optimizer state beyond the adapter: {sorted(state_of - trainable)}"


def test_kl_reference_is_the_base_model_without_a_copy(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _lora_trainer(tiny_model_dir, tmp_path, kind, kl_coef=0.1)
    try:
        assert trainer.reference_model is None, "LoRA must not load a second copy of the model"
        batch = _stepped(trainer, tiny_model_dir)
        metrics = trainer.train_step(batch)
        ref_model, ref_mode = trainer._reference()
        ids, mask = batch.input_ids, batch.attention_mask
        with torch.no_grad(), ref_mode:
            ref, _ = trainer._forward_logprobs(ref_model, ids, mask)
        policy = trainer.logprobs(batch)
    finally:
        trainer.close()
    base = next_token_logprobs(reference_model(tiny_model_dir), batch, worker.TEMPERATURE)
    padded = torch.nn.functional.pad(ref, (1, 0))
    assert worker.attended_diff(padded, base, batch) <= TOL, "the reference is not the base model's logprobs"
    # The check can fail: the trained policy is no longer the base model.
    assert worker.attended_diff(policy, base, batch) > 1e-4, "the adapter changed nothing (test cannot tell)"
    assert metrics["kl/ref"] > 0, metrics


def test_checkpoint_holds_the_adapter_and_resumes_exactly(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    _check_checkpoint_resumes(kind, tiny_model_dir, tmp_path)


def test_torchtitan_checkpoint_with_recomputed_layers_holds_the_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Activation checkpointing wraps each decoder layer, so its parameters' names differ
    from the state dict's: the checkpoint must still hold the adapter (and only it)."""
    require_torchtitan()
    _check_checkpoint_resumes("torchtitan", tiny_model_dir, tmp_path, {"activation_checkpointing": "full"})


def _check_checkpoint_resumes(kind: str, tiny_model_dir: Path, tmp_path: Path, options: dict | None = None) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    trainer = _lora_trainer(tiny_model_dir, tmp_path, kind, kl_coef=0.1, options=options)
    try:
        batch1 = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=4))
        batch2 = worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=5))
        trainer.train_step(batch1)
        trainer.save(tmp_path / "ckpt")
        expected_metrics = trainer.train_step(batch2)
        expected = worker.weights(trainer)
    finally:
        trainer.close()
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    models = [k for k in saved if k.startswith("model.")]
    assert models and all(".lora_A." in k or ".lora_B." in k for k in models), f"not only the adapter: {models}"

    resumed = _lora_trainer(tiny_model_dir, tmp_path, kind, kl_coef=0.1, options=options)
    try:
        resumed.load(tmp_path / "ckpt")
        assert resumed.train_step(batch2) == expected_metrics
        diff, name = worker.max_diff(worker.weights(resumed), expected)
    finally:
        resumed.close()
    assert diff == 0.0, f"the resumed adapter differs at {name} by {diff}"


def test_exported_adapter_loads_in_peft_with_the_trainers_logprobs(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import save_file

    from forgerl.adapters import LoraOptions

    trainer = _lora_trainer(tiny_model_dir, tmp_path, kind)
    try:
        batch = _stepped(trainer, tiny_model_dir)
        logprobs = trainer.logprobs(batch)
        exported = worker.weights(trainer)
        targets = trainer.lora_targets
    finally:
        trainer.close()
    assert all(n.startswith("base_model.model.") and n.endswith((".lora_A.weight", ".lora_B.weight")) for n in exported)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in exported.items()}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(LoraOptions(**LORA).peft_config(targets)))
    loaded = PeftModel.from_pretrained(reference_model(tiny_model_dir), str(folder))
    loaded.eval()
    diff = worker.attended_diff(next_token_logprobs(loaded, batch, worker.TEMPERATURE), logprobs, batch)
    assert diff <= TOL, f"the exported adapter gives logprobs {diff} from the trainer's"


def test_target_modules_that_match_nothing_are_a_config_error(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"match no linear layer.*q_proj"):
        _lora_trainer(tiny_model_dir, tmp_path, kind, target_modules=["attention_dense"])
    # fsdp names what matched; torchtitan adapts decoder projections only, so nothing matches.
    with pytest.raises(ConfigError, match="not linear layers" if kind == "fsdp" else "match no linear layer"):
        _lora_trainer(tiny_model_dir, tmp_path, kind, target_modules=["embed_tokens", "lm_head"])


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen3_model_dir"])
def test_torchtitan_exports_the_same_adapter_and_update_as_fsdp(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """From the same seed both trainers start from the same adapter (A drawn per Hugging
    Face layer name), give the same logprobs and, after one step on the same batch, the
    same A and B under the same names: on the tiny Qwen2 (TorchTitan's Llama code) q and
    k's B rows mapped out of TorchTitan's RoPE layout, as its weights are; on the tiny
    Qwen3 the layouts agree."""
    require_torchtitan()
    tiny_model_dir = request.getfixturevalue(fixture)
    trainers = {}
    try:
        for kind in ("torchtitan", "fsdp"):
            trainers[kind] = _lora_trainer(tiny_model_dir, tmp_path, kind, kl_coef=0.1)
        assert trainers["torchtitan"].reference_model is None, "LoRA must not load a second copy of the model"
        assert trainers["torchtitan"].lora_targets == sorted(trainers["fsdp"].lora_targets)
        start = {kind: worker.weights(t) for kind, t in trainers.items()}
        batch = worker.make_batch(tiny_model_dir, rows=3, seed=4)
        before = {kind: t.logprobs(batch) for kind, t in trainers.items()}
        stepped = worker.on_policy(trainers["fsdp"], batch)
        metrics = {kind: t.train_step(stepped) for kind, t in trainers.items()}
        after = {kind: worker.weights(t, 1) for kind, t in trainers.items()}
    finally:
        for t in reversed(trainers.values()):  # the first one made the process group
            t.close()
    assert {k: v.shape for k, v in start["torchtitan"].items()} == {k: v.shape for k, v in start["fsdp"].items()}
    assert worker.max_diff(start["torchtitan"], start["fsdp"])[0] == 0.0, "not the same initial adapter"
    assert worker.attended_diff(before["torchtitan"], before["fsdp"], batch) <= TOL
    tt, fs = metrics["torchtitan"], metrics["fsdp"]
    assert tt.keys() == fs.keys(), sorted(tt.keys() ^ fs.keys())
    for key in tt:
        assert tt[key] == pytest.approx(fs[key], rel=1e-4, abs=1e-5), f"{key}: {tt[key]} vs {fs[key]}"
    diff, name = worker.max_diff(after["torchtitan"], after["fsdp"])
    assert diff <= TOL / 10, f"after one step {name} differs between torchtitan and fsdp by {diff}"
    # AdamW's first step moves B by about lr (1e-4) from zero: a wrong row order fails by that.
    moved = worker.max_diff(after["fsdp"], start["fsdp"])[0]
    assert moved > 50 * TOL / 10, f"the step hardly moved the adapter ({moved}): the comparison proves nothing"


@pytest.mark.parametrize("options", [{"compile": True}, {"tp": 2}])
def test_torchtitan_refuses_lora_with_what_it_does_not_support(options: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgerl.errors import ConfigError

    require_torchtitan()
    with pytest.raises(ConfigError, match="lora works without tensor parallelism and torch.compile"):
        worker.make_trainer(tiny_model_dir, tmp_path, 2, kind="torchtitan", lora=LORA, **options)
