"""What to do with completions that hit the length limit (DAPO, Yu et al. 2025).

A truncated completion gets judged on an unfinished answer, so its reward is noise
about the reasoning and a strong signal against "being long". DAPO offers two fixes:

- overlong filtering (``overlong: mask``): drop truncated completions from the loss.
- soft overlong punishment (``overlong: soft_penalty``): add a length penalty that
  ramps linearly from 0 to ``-penalty`` over the last ``buffer`` tokens before
  ``max_len``, so the policy learns to finish early rather than falling off a cliff.

Apply them in this order: reward + :func:`soft_overlong_penalty` -> advantages ->
loss with :func:`overlong_mask` (see :func:`apply_overlong`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .config import AlgorithmConfig


def _truncated_flags(truncated: Tensor | Sequence[str] | Sequence[bool], batch: int, device: torch.device) -> Tensor:
    if isinstance(truncated, Tensor):
        flags = truncated.to(device=device, dtype=torch.bool)
    elif len(truncated) and isinstance(truncated[0], str):
        # Generator finish reasons ("stop" | "length" | "abort"): "length" means cut off.
        flags = torch.tensor([r == "length" for r in truncated], dtype=torch.bool, device=device)
    else:
        flags = torch.tensor([bool(t) for t in truncated], dtype=torch.bool, device=device)
    if flags.shape != (batch,):
        raise ValueError(f"need one truncated flag per row ({batch}), got shape {tuple(flags.shape)}")
    return flags


def overlong_mask(mask: Tensor, truncated: Tensor | Sequence[str] | Sequence[bool]) -> Tensor:
    """``mask`` ``[B, T]`` with every row of a truncated completion zeroed.

    ``truncated``: ``[B]`` bools, or the generator's finish reasons (``"length"`` =
    truncated). Returns a new mask of the same dtype.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    flags = _truncated_flags(truncated, mask.shape[0], mask.device)
    return torch.where(flags.unsqueeze(-1), torch.zeros_like(mask), mask)


def soft_overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, to add to the reward. ``[B]`` -> ``[B]``, <= 0.

        R(L) = 0                                 if L <= max_len - buffer
             = penalty * (max_len - buffer - L) / buffer   if max_len - buffer < L <= max_len
             = -penalty                          if L > max_len

    ``lengths`` are completion lengths in tokens; ``max_len`` is the generation limit
    (DAPO: 20480 with buffer 4096, i.e. an expected length of 16384).
    """
    if not 0 <= buffer < max_len:
        raise ValueError(
            f"overlong_buffer ({buffer}) must be >= 0 and below the max completion length ({max_len}): "
            "lower algorithm.overlong_buffer (DAPO used 4096 with 20480-token completions) "
            "or raise max_tokens"
        )
    if not penalty >= 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    lengths = lengths.to(torch.float64)
    if buffer == 0:
        out = torch.where(lengths > max_len, -1.0, 0.0).to(torch.float64)
    else:
        out = (((max_len - buffer) - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return (penalty * out).to(torch.get_default_dtype())


def apply_overlong(
    config: AlgorithmConfig,
    rewards: Tensor,
    mask: Tensor,
    lengths: Tensor,
    truncated: Tensor | Sequence[str] | Sequence[bool],
    max_len: int,
) -> tuple[Tensor, Tensor]:
    """Apply ``config.overlong`` to per-sample ``rewards`` ``[B]`` and ``mask`` ``[B, T]``.

    Call before computing advantages (the penalty is part of the reward). Returns
    ``(rewards, mask)``; the unused one is returned unchanged.
    """
    if config.overlong == "mask":
        return rewards, overlong_mask(mask, truncated)
    if config.overlong == "soft_penalty":
        pen = soft_overlong_penalty(lengths, max_len, config.overlong_buffer, config.overlong_penalty)
        return rewards + pen.to(device=rewards.device, dtype=rewards.dtype), mask
    return rewards, mask
