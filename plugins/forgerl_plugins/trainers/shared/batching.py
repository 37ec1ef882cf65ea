"""How one full batch is cut into this rank's micro-batches.

Every rank receives the same full ``[B, T]`` batch. Rank ``r`` of ``W`` takes a contiguous
block of rows (the first ``B % W`` ranks one row more, like ``torch.tensor_split``), so a
rank may get no rows at all. FSDP2 all-gathers parameters in every forward and
reduce-scatters gradients in every backward: all ranks must run the *same number* of
forward/backward passes or the collectives deadlock. So the micro-batch count is fixed by
the largest share, and a rank that runs out of rows gets "padding" micro-batches: one real
row with an empty loss mask, which contributes zero loss and zero gradient but takes part
in every collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.types import TrainBatch


def rank_rows(batch_size: int, world_size: int, rank: int) -> range:
    """The rows of a ``batch_size`` batch that ``rank`` (of ``world_size``) trains on."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} out of range for world size {world_size}: expected 0 <= rank < world size"
        )
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class MicroBatch:
    """Row indices into the full batch; ``padding`` means "keep the collectives in step,
    train on nothing" (its loss mask is zeroed)."""

    rows: list[int]
    padding: bool = False


def micro_batches(
    batch_size: int,
    world_size: int,
    rank: int,
    micro_batch_size: int | None,
    lengths: Sequence[int] | None = None,
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches, the same count on every rank.

    With ``lengths`` (tokens used per row), this rank's rows are grouped longest first:
    each micro-batch is cut to its longest row, so rows of like length together run
    fewer padding positions through the model (16 GRPO rows of 63-116 tokens in
    micro-batches of 8: 1552 positions instead of 1856). The update is the same: the
    micro-batch losses are summed with one global normaliser.

    A micro-batch takes rows while it holds at most ``micro_batch_size`` rows and at most
    ``max_tokens`` positions (rows x its longest row; needs ``lengths``); a row longer
    than ``max_tokens`` runs alone. With neither limit, the rank's whole share is one
    micro-batch.
    """
    if batch_size < 1:
        raise ValueError(
            "an empty batch cannot be trained on (every rank needs a row to run): "
            f"got batch size {batch_size}"
        )
    if lengths is not None and len(lengths) != batch_size:
        raise ValueError(f"{len(lengths)} lengths for a batch of {batch_size}: expected one length per row")
    if max_tokens is not None and lengths is None:
        raise ValueError("a token limit per micro-batch needs the rows' lengths")
    # Every rank plans every rank's share (all hold the whole batch), so all agree on the count.
    plans = [_plan(batch_size, world_size, r, micro_batch_size, lengths, max_tokens) for r in range(world_size)]
    count = max(1, *(len(plan) for plan in plans))
    mine = [MicroBatch(rows) for rows in plans[rank]]
    return mine + [MicroBatch([0], padding=True)] * (count - len(mine))


def _plan(
    batch_size: int,
    world_size: int,
    rank: int,
    micro_batch_size: int | None,
    lengths: Sequence[int] | None,
    max_tokens: int | None,
) -> list[list[int]]:
    rows = list(rank_rows(batch_size, world_size, rank))
    if lengths is not None:
        rows.sort(key=lambda row: -lengths[row])  # stable: equal lengths keep their order
    plan: list[list[int]] = []
    for row in rows:
        current = plan[-1] if plan else []
        # Rows come longest first, so a micro-batch's first row is its longest.
        longest = 0 if lengths is None else lengths[current[0] if current else row]
        n = len(current) + 1
        fits = (micro_batch_size is None or n <= micro_batch_size) and (max_tokens is None or n * longest <= max_tokens)
        if current and fits:
            current.append(row)
        else:
            plan.append([row])
    return plan


def global_count(loss_mask: torch.Tensor, loss_agg: str) -> float:
    """The normaliser of the whole batch for :func:`forgerl.algorithms.policy_loss`.

    Tokens for ``token_mean``; otherwise sequences with at least one loss token (the
    count ``aggregate_loss`` uses per call). ``loss_mask`` must be the one the loss sees
    (already shifted). At least 1, so an all-masked batch gives loss 0, not NaN.
    """
    mask = loss_mask != 0
    if loss_agg == "token_mean":
        n = int(mask.sum())
    else:
        n = int(mask.any(-1).sum())
    return float(max(n, 1))


def loss_ages(batch: TrainBatch) -> list[int]:
    """The token ages (:meth:`TrainBatch.token_ages`) under the batch's loss mask, sorted;
    empty without per-token versions."""
    import torch

    ages = batch.token_ages()
    if ages is None:
        return []
    return [int(a) for a in torch.unique(ages[batch.loss_mask != 0]).tolist()]


def row_lengths(batch: TrainBatch) -> list[int]:
    """Positions each row uses (up to its last attended or loss token), for grouping rows
    of like length into micro-batches."""
    import torch

    used = (batch.attention_mask != 0) | (batch.loss_mask != 0)
    columns = torch.arange(1, used.shape[1] + 1, device=used.device)
    return torch.where(used, columns, 0).amax(-1).tolist()


def check_batch(batch: TrainBatch) -> None:
    shape = tuple(batch.input_ids.shape)
    if len(shape) != 2 or shape[0] < 1:
        raise ValueError(f"input_ids must be [B, T] with B >= 1, got {shape}")
    for name in ("attention_mask", "loss_mask", "behaviour_logprobs"):
        got = tuple(getattr(batch, name).shape)
        if got != shape:
            raise ValueError(f"{name} has shape {got}, expected input_ids' {shape}")
    if batch.token_versions is not None and tuple(batch.token_versions.shape) != shape:
        raise ValueError(f"token_versions has shape {tuple(batch.token_versions.shape)}, expected input_ids' {shape}")
    adv = tuple(batch.advantages.shape)
    if adv not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, T] for input_ids {shape}, got {adv}")
    if batch.images is not None and len(batch.images) != shape[0]:
        raise ValueError(f"images must have one entry per row: {len(batch.images)} for {shape[0]} rows")
