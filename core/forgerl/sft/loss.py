"""The supervised objective: the mean negative log-likelihood of the trained tokens.

What transformers computes for a causal LM given ``labels`` that are ``-100`` outside the
mask (``ForCausalLMLoss``: cross-entropy of each shifted label, summed and divided by the
number of labels that count), and so what TRL's SFTTrainer trains. Over a batch split into
micro-batches (and ranks) each part divides by the count of the whole batch
(``global_count``), so the parts' losses and gradients add up to the batch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The keys :func:`sft_loss` reports (``entropy`` only when given one).
METRIC_KEYS: tuple[str, ...] = ("loss/sft", "entropy")


def sft_loss(
    logprobs: Tensor, mask: Tensor, *, global_count: float | None = None, entropy: Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """``-sum(logprobs over mask) / count``: ``logprobs`` ``[B, T]`` are the model's
    log-probabilities of the tokens (with grad), ``mask`` ``[B, T]`` nonzero where a token
    is trained on; ``count`` the mask's tokens, or ``global_count``. Masked-out positions
    may hold anything (even inf): they are replaced before any arithmetic."""
    if logprobs.shape != mask.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match logprobs {tuple(logprobs.shape)}")
    m = mask != 0
    picked = torch.where(m, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    count = m.sum().clamp(min=1) if global_count is None else global_count
    loss = -picked.sum() / count
    values = {"loss/sft": loss.detach()}
    if entropy is not None:
        ent = torch.where(m, entropy.detach(), torch.zeros((), dtype=entropy.dtype, device=entropy.device))
        values["entropy"] = ent.sum() / m.sum().clamp(min=1)
    keys = list(values)
    numbers = torch.stack([values[k].to(torch.float64) for k in keys]).tolist()
    return loss, dict(zip(keys, numbers))
