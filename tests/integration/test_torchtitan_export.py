"""`forge export` of ``torchtitan`` runs: its checkpoints hold TorchTitan's parameter names
(q/k rows in TorchTitan's RoPE layout), and the exported folder must still be the Hugging
Face model whose logits are the trainer's own model's, full weights (with activation
checkpointing, q/k biases and a tied output layer) and LoRA (merged, or the adapter on
its base through PEFT).

As in test_export.py, a run directory is made in process: its config.yaml, and a
checkpoint written by ``forgerl.checkpoints.checkpoint.save`` with the trainer's own ``save`` after
real training steps."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.testing.trainer_support import reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402
from tests.integration.test_export import forge_export  # noqa: E402

pytestmark = pytest.mark.integration

#: Logits of two model codes (TorchTitan's and transformers') in float32.
TOL = 1e-5
LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_torchtitan()


def _titan_run(model_dir: Path, run_dir: Path, options: dict) -> tuple[object, torch.Tensor]:
    """A torchtitan run directory with a checkpoint of step 2; the batch and the trainer
    model's logits of it at that checkpoint."""
    from forgerl.checkpoints import checkpoint
    from forgerl.checkpoints.checkpoint_format import Snapshot, capture_rng
    from forgerl.configuration.config import RunConfig
    from forgerl.rundirs.runs import write_config

    config = RunConfig.model_validate(
        {"model": {"name": str(model_dir)}, "trainer": {"name": "torchtitan", "options": options}, "loop": {"seed": 0}}
    )
    run_dir.mkdir()
    write_config(run_dir, config)
    trainer = worker.make_trainer(model_dir, run_dir, 2, kind="torchtitan", **options)
    try:
        batch = worker.on_policy(trainer, worker.make_batch(model_dir, rows=3, seed=4))
        for _ in range(2):
            trainer.train_step(batch)
        rng, arrays = capture_rng()
        state = {"step": 2, "policy_version": 2, "task_state": {}, "next_rollout_index": 2,
                 "time_totals": {}, "eval_start": None, "eval_last": None, "rng": rng}
        checkpoint.save(run_dir, 2, Snapshot(state=state, arrays=arrays), trainer.save, keep=5)
        with torch.no_grad():
            logits = trainer.model(batch.input_ids).float()
    finally:
        trainer.close()
    return batch, logits


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()


def _diff(a: torch.Tensor, b: torch.Tensor, batch) -> float:
    """The largest logit difference at attended positions."""
    return (a - b).abs()[batch.attention_mask != 0].max().item()


def _assert_policy(got: torch.Tensor, expected: torch.Tensor, batch, model_dir: Path) -> None:
    diff = _diff(got, expected, batch)
    assert diff <= TOL, f"the exported model's logits are {diff} from the torchtitan trainer's"
    moved = _diff(got, _logits(reference_model(model_dir), batch), batch)
    assert moved > 100 * TOL, f"the exported model is the base model (logits {moved} apart): the check proves nothing"


def test_full_weight_run_exports_the_trained_policy(biased_model_dir: Path, tmp_path: Path, capsys) -> None:
    # Activation checkpointing wraps each decoder layer (parameter names change, state
    # dict names do not); random q/k biases are permuted like their weights' rows; the
    # tiny Qwen2 ties its output layer to the embeddings.
    run_dir = tmp_path / "run"
    batch, logits = _titan_run(biased_model_dir, run_dir, {"activation_checkpointing": "full"})
    out = tmp_path / "model"
    code, stdout, err = forge_export(str(run_dir), "--output", str(out), capsys=capsys)
    assert code == 0, err
    assert stdout.strip() == str(out)
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    _assert_policy(_logits(reference_model(out), batch), logits, batch, biased_model_dir)

    # The same checkpoint read as an fsdp one is refused in one line (its names are not
    # the Hugging Face model's), leaving nothing.
    as_fsdp = tmp_path / "as-fsdp"
    shutil.copytree(run_dir, as_fsdp)
    config = as_fsdp / "config.yaml"
    config.write_text(config.read_text().replace("name: torchtitan", "name: fsdp"))
    code, _, err = forge_export(str(as_fsdp), "--output", str(tmp_path / "o"), capsys=capsys)
    assert code == 2 and re.search("do not fit the model", err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_lora_run_exports_merged_and_as_a_peft_adapter(llama_model_dir: Path, tmp_path: Path, capsys) -> None:
    # Llama: the adapter's B rows of q and k are permuted into Hugging Face's layout.
    from peft import PeftModel

    run_dir = tmp_path / "run"
    batch, logits = _titan_run(llama_model_dir, run_dir, {"lora": LORA})
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    code, _, err = forge_export(str(run_dir), "--output", str(merged), capsys=capsys)
    assert code == 0, err
    assert not (merged / "adapter_config.json").exists(), "a merged model is a plain model"
    _assert_policy(_logits(reference_model(merged), batch), logits, batch, llama_model_dir)

    code, _, err = forge_export(str(run_dir), "--output", str(adapter), "--adapter-only", capsys=capsys)
    assert code == 0, err
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and "q_proj" in str(config["target_modules"]), config
    peft = PeftModel.from_pretrained(reference_model(llama_model_dir), str(adapter)).eval()
    _assert_policy(_logits(peft, batch), logits, batch, llama_model_dir)
