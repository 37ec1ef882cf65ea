"""Apply the LM head only where the loss reads a logprob.

A causal LM computes ``[b, L, V]`` logits, but a GRPO loss reads one logprob per
*completion* token: prompt and padding positions are thrown away after the most
expensive matrix product of the step (for SmolLM2-135M the head is a fifth of the
weights, and its vocabulary-wide softmax comes on top). Here a forward pre-hook on the
model's output projection hands it only the hidden states at the wanted positions, as one
``[1, N, H]`` row, so the model's logits come back as ``[1, N, V]``. Whatever the model
does after its head (logit scaling, soft-capping) still runs, on those rows only; the
decoder's attention is untouched (every position still attends to its whole prefix).

Whether a model's head works this way is checked once, on a tiny input, by
:func:`head_selection_works`; models that call their head differently keep full logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


@contextlib.contextmanager
def head_at(head: Any, positions: torch.Tensor) -> Iterator[None]:
    """While active, the output projection ``head`` sees only the hidden states where
    ``positions`` (``[b, P]`` bool, ``P <= L``: position t's logits predict token t+1) is true."""

    def pick(_module: Any, args: tuple) -> tuple:
        hidden = args[0]
        if hasattr(hidden, "to_local"):
            return (_pick_replicated(hidden, positions), *args[1:])
        return (hidden[:, : positions.shape[1]][positions].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def _pick_replicated(hidden: Any, positions: torch.Tensor) -> Any:
    """The selection on a DTensor (a tensor-parallel head's input): every rank holds the
    whole tensor (Replicate), so each selects from its own copy."""
    from torch.distributed.tensor import DTensor, Replicate

    if not all(isinstance(p, Replicate) for p in hidden.placements):
        raise RuntimeError(f"head_at needs the head's input replicated, got placements {hidden.placements}")
    local = hidden.to_local()[:, : positions.shape[1]][positions].unsqueeze(0)
    return DTensor.from_local(local, hidden.device_mesh, hidden.placements, run_check=False)


def head_selection_works(
    logits_of: Callable[[torch.Tensor], torch.Tensor], head: Any, vocab_size: int, device: torch.device
) -> bool:
    """Whether :func:`head_at` on ``head`` gives the same logits as a full forward
    (``logits_of(ids)``, ``[1, L, V]``), tried on a 4-token input (every rank calls this:
    with FSDP the forwards are collectives)."""
    import torch

    if head is None:
        return False
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % vocab_size
    positions = torch.tensor([[False, True, False, True]], device=device)
    with torch.no_grad():
        full = logits_of(ids)
        with head_at(head, positions):
            picked = logits_of(ids)
    if tuple(picked.shape) != (1, 2, full.shape[-1]):
        return False
    return bool(torch.allclose(picked[0], full[0, [1, 3]], rtol=1e-4, atol=1e-5))
