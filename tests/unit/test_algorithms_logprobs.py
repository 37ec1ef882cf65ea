"""Chunked per-token logprobs / entropy: values, gradients, dtypes and what autograd keeps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forgerl.algorithms import (
    naive_selective_logprobs,
    naive_token_entropy,
    selective_logprobs,
    token_entropy,
)

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ref_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> list[list[float]]:
    out = []
    for b in range(logits.shape[0]):
        row = []
        for t in range(logits.shape[1]):
            xs = logits[b, t].tolist()
            m = max(xs)
            lse = m + math.log(sum(math.exp(x - m) for x in xs))
            row.append(xs[int(ids[b, t])] - lse)
        out.append(row)
    return out


def ref_entropy(logits: torch.Tensor) -> list[list[float]]:
    out = []
    for b in range(logits.shape[0]):
        row = []
        for t in range(logits.shape[1]):
            xs = logits[b, t].tolist()
            m = max(xs)
            z = sum(math.exp(x - m) for x in xs)
            ps = [math.exp(x - m) / z for x in xs]
            row.append(-sum(p * math.log(p) for p in ps if p > 0))
        out.append(row)
    return out


def _data(seed: int, b: int, t: int, v: int, dtype=torch.float64, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    return logits, ids


@FAST
@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 6), st.integers(1, 9), st.integers(1, 8))
def test_logprobs_and_entropy_match_python_reference(seed, b, t, v, chunk):
    logits, ids = _data(seed, b, t, v)
    got = selective_logprobs(logits, ids, chunk_size=chunk)
    assert got.dtype == torch.float64 and got.shape == (b, t)
    flat_want = [x for row in ref_logprobs(logits, ids) for x in row]
    assert got.reshape(-1).tolist() == pytest.approx(flat_want, rel=1e-10, abs=1e-12)
    ent = token_entropy(logits, chunk_size=chunk)
    flat_ent = [x for row in ref_entropy(logits) for x in row]
    assert ent.reshape(-1).tolist() == pytest.approx(flat_ent, rel=1e-10, abs=1e-12)


# Two blocks within one row / two rows grouped into one block.
@pytest.mark.parametrize("shape,chunk", [((1, 3, 3), 2), ((2, 2, 3), 100)])
def test_gradcheck(shape, chunk):
    logits, ids = _data(0, *shape)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: selective_logprobs(x, ids, chunk), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, chunk), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_naive_values_and_gradients(dtype):
    logits, ids = _data(1, 3, 7, 50, dtype=dtype)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = selective_logprobs(a, ids, chunk_size=4)
    want = naive_selective_logprobs(b, ids)
    assert got.dtype == want.dtype == torch.float32  # bf16 logits are upcast
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = torch.randn(3, 7)  # arbitrary upstream gradient
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)

    a.grad = b.grad = None
    (token_entropy(a, chunk_size=5) * w).sum().backward()
    (naive_token_entropy(b) * w).sum().backward()
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol * 10, atol=tol * 10)


def test_shifted_noncontiguous_slice():
    # logits[:, :-1] is the usual next-token alignment; it is not viewable as [B*T, V].
    logits, ids = _data(2, 3, 9, 11)
    sliced = logits.requires_grad_(True)[:, :-1]
    assert not sliced.is_contiguous()
    got = selective_logprobs(sliced, ids[:, 1:], chunk_size=5)
    torch.testing.assert_close(got, naive_selective_logprobs(sliced, ids[:, 1:]))
    got.sum().backward()
    assert logits.grad[:, -1].abs().sum() == 0 and logits.grad[:, :-1].abs().sum() > 0


def test_no_grad_and_banned_tokens():
    logits, ids = _data(3, 2, 3, 6)
    logits[..., 0] = -math.inf  # a banned token: probability 0
    ids = ids.clamp(min=1)
    with torch.no_grad():
        lp = selective_logprobs(logits, ids)
        ent = token_entropy(logits)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(ent, naive_token_entropy(logits.nan_to_num(neginf=-1e30)))
    x = logits.clone().requires_grad_(True)
    token_entropy(x).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[..., 0] == 0).all()


def test_bad_ids_refused():
    logits, ids = _data(4, 1, 3, 5)
    with pytest.raises(ValueError, match="-100"):
        selective_logprobs(logits, torch.full((1, 3), -100))
    with pytest.raises(ValueError, match="must be in"):
        selective_logprobs(logits, torch.full((1, 3), 5))
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        selective_logprobs(logits[0], ids[0])
    with pytest.raises(ValueError, match="must be logits"):
        selective_logprobs(logits, ids[:, :2])


def _saved_bytes(fn, logits: torch.Tensor) -> int:
    """Bytes autograd keeps for backward, excluding views of the logits themselves."""
    total = 0
    base = logits.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        nonlocal total
        if t.untyped_storage().data_ptr() != base:
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_one_float_per_token_not_per_vocab_entry(dtype):
    b, t, v = 2, 16, 512
    logits, ids = _data(5, b, t, v, dtype=dtype)
    logits.requires_grad_(True)
    chunked = _saved_bytes(lambda: selective_logprobs(logits, ids, chunk_size=8), logits)
    naive = _saved_bytes(lambda: naive_selective_logprobs(logits, ids), logits)
    per_token = b * t * (4 + 8)  # fp32 logsumexp + int64 id
    assert chunked <= per_token, chunked
    assert naive >= b * t * v * 4  # the fp32 log-softmax: the cost we avoid
    ent = _saved_bytes(lambda: token_entropy(logits, chunk_size=8), logits)
    assert ent <= b * t * 8
