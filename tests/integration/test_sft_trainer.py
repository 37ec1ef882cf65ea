"""The ``sft`` objective in the ``fsdp`` and ``torchtitan`` trainers: on a batch of rendered
demonstrations (a tool conversation, prompt + completion pairs, text) cut into several
micro-batches, the loss and its gradient are what transformers computes for the same
labels (``-100`` outside the loss mask: what TRL's SFTTrainer trains), within 1e-5 in
fp32, whatever the sampling temperature; LoRA trains the adapter alone on it."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from forgerl.sft.batch import collate  # noqa: E402
from forgerl.sft.render import Renderer  # noqa: E402
from forgerl.sft.rows import parse_row  # noqa: E402
from forgerl.testing.trainer_support import reference_model  # noqa: E402
from tests.helpers import trainer_worker as worker  # noqa: E402
from tests.helpers.requires import require_torchtitan  # noqa: E402

from ..unit.test_sft_render import calculator_demo  # noqa: E402

pytestmark = pytest.mark.integration

TOL = 1e-5
ROWS = [
    {"messages": [{"role": "user", "content": "What is 3 + 4?"},
                  {"role": "assistant", "content": "3 + 4 = 7, so the answer is <answer>7</answer>."}]},
    {"prompt": "What is 2 + 2?", "completion": " 4"},
    {"text": "the sum of the number is correct"},
    {"prompt": [{"role": "user", "content": "What is 12 - 5?"}], "completion": "so the answer is 7"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}],
     "completion": "<answer>2</answer>"},
]  # fmt: skip


def sft_batch(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = Renderer(tokenizer, max_length=1024)
    rows = [calculator_demo(), *ROWS]
    examples = [renderer.render(parse_row(row, f"row {i}")).example for i, row in enumerate(rows)]
    assert all(e is not None for e in examples)
    return collate(examples, pad_id=tokenizer.pad_token_id)  # type: ignore[arg-type]


def transformers_loss(model_dir: Path, batch) -> tuple[float, float]:
    """transformers' loss of the batch (labels -100 outside the loss mask) and the norm of
    its gradient."""
    model = reference_model(model_dir)
    labels = torch.where(batch.loss_mask != 0, batch.input_ids, -100)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(out.loss.detach()), float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


@pytest.fixture(params=worker.TRAINERS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "torchtitan":
        require_torchtitan()
    return request.param


def test_sft_loss_and_gradient_equal_transformers(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = sft_batch(tiny_model_dir)
    expected_loss, expected_norm = transformers_loss(tiny_model_dir, batch)
    # Micro-batches of 2 rows: each divides by the whole batch's count. The run's sampling
    # temperature (0.7 here) is the RL loss's business, not the cross-entropy's.
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2, kind=kind)
    try:
        metrics = trainer.train_step(batch)
    finally:
        trainer.close()
    assert abs(metrics["loss"] - expected_loss) <= TOL, (metrics["loss"], expected_loss)
    assert metrics["loss/sft"] == metrics["loss"]
    assert abs(metrics["grad_norm"] - expected_norm) <= TOL * max(1.0, expected_norm), (metrics, expected_norm)
    assert metrics["train/tokens"] == float((batch.loss_mask[:, 1:] != 0).sum())
    assert metrics["train/sequences"] == batch.size


def test_lora_sft_trains_the_adapter_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    batch = sft_batch(tiny_model_dir)
    expected_loss, _ = transformers_loss(tiny_model_dir, batch)
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=3, lr=1e-2, lora={"rank": 4, "alpha": 8})
    try:
        losses = [trainer.train_step(batch)["loss"] for _ in range(4)]
        exported = trainer.export_weights(1)
    finally:
        trainer.close()
    # A fresh adapter (B = 0) leaves the base model's loss; training lowers it.
    assert abs(losses[0] - expected_loss) <= TOL, (losses[0], expected_loss)
    assert losses[-1] < losses[0] - 0.05, losses
    assert exported is not None and exported.tensors
    assert all(".lora_A." in name or ".lora_B." in name for name in exported.tensors), sorted(exported.tensors)[:4]


def test_a_trainer_refuses_an_objective_it_does_not_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    import dataclasses

    batch = dataclasses.replace(sft_batch(tiny_model_dir), objective="distill")
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        with pytest.raises(ValueError, match="the fsdp trainer trains \\['grpo', 'sft'\\], not 'distill'"):
            trainer.train_step(batch)
    finally:
        trainer.close()
