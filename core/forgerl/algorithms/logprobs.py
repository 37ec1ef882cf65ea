"""Per-token logprobs and entropies from logits, without a full-vocabulary log-softmax.

The obvious ``log_softmax(logits.float(), -1).gather(...)`` allocates an fp32
``[B, T, V]`` tensor (plus an fp32 copy of bf16 logits, plus what autograd saves for
the backward): with V ~ 150k that is several GB for one micro-batch, just to keep one
number per token. Here we walk over blocks of about ``chunk_size`` tokens, upcast only
that block to fp32, take its ``log_softmax`` and gather the chosen token. Only the
logits themselves (which the model already holds) and the token ids are kept for the
backward, which recomputes the softmax block by block; so the extra memory is
O(chunk_size * V) instead of O(B * T * V), in both passes.

Blocks are views into ``logits`` (no ``reshape`` of the whole tensor), so the common
shifted slice ``logits[:, :-1]`` is not copied either.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_SIZE = 512  # tokens per block: 512 x 152k vocab x 4 B ~ 300 MB of fp32 scratch


def _blocks(batch: int, length: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """Cover [batch, length] with blocks of at most `rows` tokens, as (batch, time) slices."""
    if length >= rows:
        for b in range(batch):
            for t0 in range(0, length, rows):
                yield slice(b, b + 1), slice(t0, min(t0 + rows, length))
    else:
        per = max(1, rows // max(length, 1))
        for b0 in range(0, batch, per):
            yield slice(b0, min(b0 + per, batch)), slice(0, length)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are upcast per block: their ~3 significant digits are not enough
    # for ratios exp(logp - old_logp) close to 1. fp64 stays fp64 (gradcheck). The upcast
    # goes through (log_)softmax's dtype= argument: torch fuses it into the kernel for
    # fp16 on CUDA and otherwise makes a block-sized fp32 copy, which is what we budget.
    return torch.promote_types(dtype, torch.float32)


def _check(logits: Tensor, chunk_size: int) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not chunk_size >= 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _SelectiveLogprobs(torch.autograd.Function):
    # Per block, log_softmax + gather rather than logsumexp: torch's fused log_softmax
    # kernel was faster than logsumexp (max, subtract, exp, sum, log) in our CPU runs, and
    # the backward recomputes the block's softmax from the logits, so nothing per
    # vocabulary entry is ever saved.
    @staticmethod
    def forward(ctx: Any, logits: Tensor, token_ids: Tensor, chunk_size: int) -> Tensor:
        batch, length, _ = logits.shape
        cdt = _compute_dtype(logits.dtype)
        out = torch.empty(batch, length, dtype=cdt, device=logits.device)
        for bs, ts in _blocks(batch, length, chunk_size):
            logp = torch.log_softmax(logits[bs, ts], dim=-1, dtype=cdt)
            out[bs, ts] = logp.gather(-1, token_ids[bs, ts].unsqueeze(-1)).squeeze(-1)
            del logp  # free this block before the next one is allocated: one block live at a time
        ctx.save_for_backward(logits, token_ids)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, token_ids = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        batch, length, _ = logits.shape
        for bs, ts in _blocks(batch, length, ctx.chunk_size):
            # d(log softmax(x)_y)/dx_j = 1[j = y] - softmax(x)_j
            g = grad_out[bs, ts].unsqueeze(-1)
            block = torch.softmax(logits[bs, ts], dim=-1, dtype=grad_out.dtype)
            block.mul_(-g)
            block.scatter_add_(-1, token_ids[bs, ts].unsqueeze(-1), g)
            grad[bs, ts] = block.to(logits.dtype)
            del block
        return grad, None, None


def selective_logprobs(logits: Tensor, token_ids: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """``log softmax(logits)[b, t, token_ids[b, t]]`` as ``[B, T]``, block by block.

    ``logits`` ``[B, T, V]`` must already be aligned with ``token_ids`` ``[B, T]`` (logits
    at position t predict token t; shift before calling). Every id must be in
    ``[0, V)``, padding included (use the pad id, not -100). Result is fp32 for
    bf16/fp16/fp32 logits, fp64 for fp64. Differentiable w.r.t. ``logits``.
    """
    _check(logits, chunk_size)
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_ids {tuple(token_ids.shape)} must be logits' [B, T] {tuple(logits.shape[:2])}"
        )
    if token_ids.is_floating_point():
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.numel():
        lo, hi = torch.stack([token_ids.min(), token_ids.max()]).tolist()  # one host sync
        if not (0 <= lo and hi < logits.shape[-1]):
            raise ValueError(
                f"token ids must be in [0, {logits.shape[-1]}), got range [{lo}, {hi}] "
                "(replace ignore-index padding such as -100 by a real id; the mask drops it)"
            )
    return _SelectiveLogprobs.apply(logits, token_ids.long(), chunk_size)


def naive_selective_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Reference: full fp32 ``log_softmax`` then ``gather`` (O(B*T*V) extra memory)."""
    cdt = _compute_dtype(logits.dtype)
    return torch.log_softmax(logits.to(cdt), dim=-1).gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, chunk_size: int) -> Tensor:
        batch, length, _ = logits.shape
        cdt = _compute_dtype(logits.dtype)
        ent = torch.empty(batch, length, dtype=cdt, device=logits.device)
        for bs, ts in _blocks(batch, length, chunk_size):
            logp = torch.log_softmax(logits[bs, ts], dim=-1, dtype=cdt)
            # H = -sum_j p_j log p_j; where(): a -inf logit (banned token) has p = 0 and
            # contributes 0, not 0 * -inf = NaN.
            ent[bs, ts] = -torch.where(logp > -torch.inf, logp.exp() * logp, 0.0).sum(-1)
            del logp
        ctx.save_for_backward(logits, ent)
        ctx.chunk_size = chunk_size
        return ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, ent = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        batch, length, _ = logits.shape
        for bs, ts in _blocks(batch, length, ctx.chunk_size):
            # dH/dx_j = -p_j (log p_j + H)
            logp = torch.log_softmax(logits[bs, ts], dim=-1, dtype=ent.dtype)
            block = torch.where(logp > -torch.inf, -logp.exp() * (logp + ent[bs, ts].unsqueeze(-1)), 0.0)
            block.mul_(grad_out[bs, ts].unsqueeze(-1))
            grad[bs, ts] = block.to(logits.dtype)
            del logp, block
        return grad, None


def token_entropy(logits: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of the next-token distribution at each position, ``[B, T]``, block by block.

    Same memory behaviour and dtype rules as :func:`selective_logprobs`; differentiable
    (for an entropy bonus), though it is usually logged under ``torch.no_grad()``.
    """
    _check(logits, chunk_size)
    return _TokenEntropy.apply(logits, chunk_size)


def naive_token_entropy(logits: Tensor) -> Tensor:
    """Reference: full fp32 softmax (O(B*T*V) extra memory)."""
    logp = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)
    return -(logp.exp() * logp).sum(-1)
