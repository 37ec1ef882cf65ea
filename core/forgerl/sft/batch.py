"""Rendered examples as one padded :class:`~forgerl.types.TrainBatch` of the ``sft``
objective: right-padded rows, the loss mask where the example trains, and zeros where the
RL loss would read advantages, sampling logprobs and versions."""

from __future__ import annotations

from collections.abc import Sequence

from forgerl.sft.render import Example
from forgerl.types import TrainBatch


def collate(examples: Sequence[Example], *, pad_id: int) -> TrainBatch:
    import torch

    if not examples:
        raise ValueError("an empty batch cannot be trained on")
    B, T = len(examples), max(len(e.input_ids) for e in examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    loss_mask[:, 0] = 0.0  # nothing predicts a row's first token
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=torch.zeros((B, T), dtype=torch.float32),
        advantages=torch.zeros(B, dtype=torch.float32),
        policy_versions=torch.zeros(B, dtype=torch.long),
        objective="sft",
    )
