"""Episodes → advantages → a padded TrainBatch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forgerl.types import Episode, TrainBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from forgerl.algorithms import AlgorithmConfig


@dataclass
class Prepared:
    batch: TrainBatch | None
    episodes: list[Episode]
    filtered_groups: int
    num_groups: int
    #: What the objective adds to the step's row (``objective: distill``: ``distill/*``).
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_batch(
    episodes: Sequence[Episode],
    config: AlgorithmConfig,
    *,
    max_tokens: int,
    pad_id: int,
    trainer_version: int | None = None,
    min_version: int | None = None,
) -> Prepared:
    """Group-relative advantages (with overlong handling and zero-variance filtering per
    ``config``), then pad into a batch. Episodes must carry ``group_id``.

    ``trainer_version``: the version of the weights the batch trains (the batch's token
    ages count from it). ``min_version``: the oldest version a token may have to be trained
    on; older tokens stay in the rows as context, out of the loss (see :func:`collate`)."""
    import torch

    from forgerl.algorithms import apply_overlong, group_advantages, zero_variance_groups

    episodes = list(episodes)
    if not episodes:
        return Prepared(None, [], 0, 0)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    group_ids = torch.tensor([e.group_id for e in episodes], dtype=torch.long)
    # Dense group ids, as the advantage functions expect 0..G-1.
    _, group_ids = torch.unique(group_ids, return_inverse=True)
    lengths = torch.tensor([len(e.completion.token_ids) for e in episodes])
    truncated = [e.completion.finish_reason == "length" for e in episodes]

    batch = collate(episodes, pad_id=pad_id, min_version=min_version)
    batch.trainer_version = trainer_version
    rewards, loss_mask = apply_overlong(config, rewards, batch.loss_mask, lengths, truncated, max_tokens)
    batch.loss_mask = loss_mask
    adv = group_advantages(rewards, group_ids, std_normalize=config.std_normalize, eps=config.std_eps)
    num_groups = int(group_ids.max()) + 1
    filtered = 0
    if config.filter_zero_variance:
        zv = zero_variance_groups(rewards, group_ids)
        filtered = zv.num_dropped_groups
        keep = zv.keep
        if not bool(keep.any()):
            # Every group is uniform: nothing to learn from this batch. Keep it (all
            # advantages are zero) so the step still happens and versions stay in step.
            keep = torch.ones_like(keep)
        idx = keep.nonzero().flatten()
        episodes = [episodes[i] for i in idx.tolist()]
        adv = adv[idx]
        batch = _select(batch, idx)
    for e, a in zip(episodes, adv.tolist()):
        e.advantage = float(a)
    batch.advantages = adv.to(torch.float32)
    batch.num_groups = num_groups - filtered
    return Prepared(batch, episodes, filtered, num_groups)


def tokens_by_age(batch: TrainBatch) -> dict[int, int]:
    """Loss tokens of ``batch`` per age (versions older than the trained weights); empty
    without per-token versions."""
    import torch

    ages = batch.token_ages()
    if ages is None:
        return {}
    values, counts = torch.unique(ages[batch.loss_mask != 0], return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def collate(episodes: Sequence[Episode], *, pad_id: int, min_version: int | None = None) -> TrainBatch:
    """Prompt + completion per row, right-padded. Position ``t`` of ``behaviour_logprobs``,
    ``loss_mask`` and ``token_versions`` refers to token ``input_ids[:, t]``.

    The loss mask covers the sampled tokens of a completion (a trajectory's environment
    tokens are context) whose version is at least ``min_version`` (None: any version)."""
    import torch

    from forgerl.rollouts.staleness import oldest_version, token_versions

    lengths = [len(e.prompt_token_ids) + len(e.completion.token_ids) for e in episodes]
    B, T = len(episodes), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    row_versions = torch.tensor([oldest_version(e.completion) for e in episodes], dtype=torch.long)
    versions = row_versions.unsqueeze(1).repeat(1, T)
    for i, e in enumerate(episodes):
        p, c = len(e.prompt_token_ids), len(e.completion.token_ids)
        input_ids[i, :p] = torch.tensor(e.prompt_token_ids, dtype=torch.long)
        if c:
            input_ids[i, p : p + c] = torch.tensor(e.completion.token_ids, dtype=torch.long)
            behaviour[i, p : p + c] = torch.tensor(e.completion.logprobs, dtype=torch.float32)
            versions[i, p : p + c] = torch.tensor(token_versions(e.completion), dtype=torch.long)
            mask = e.completion.mask
            # A trajectory's environment tokens (mask 0) are context, never trained on.
            loss_mask[i, p : p + c] = 1.0 if mask is None else torch.tensor(mask, dtype=torch.float32)
        attention[i, : p + c] = 1
    if min_version is not None:
        # Tokens older than allowed (loop.stale_samples: mask) stay as context only.
        loss_mask = torch.where(versions >= min_version, loss_mask, 0.0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=torch.zeros(B, dtype=torch.float32),
        policy_versions=row_versions,
        token_versions=versions,
        # The pixels the generator saw go with the row: the trainer never reloads an image.
        images=[e.images for e in episodes] if any(e.images is not None for e in episodes) else None,
    )


def _select(batch: TrainBatch, idx: torch.Tensor) -> TrainBatch:
    return TrainBatch(
        input_ids=batch.input_ids[idx],
        attention_mask=batch.attention_mask[idx],
        loss_mask=batch.loss_mask[idx],
        behaviour_logprobs=batch.behaviour_logprobs[idx],
        advantages=batch.advantages[idx],
        policy_versions=batch.policy_versions[idx],
        num_groups=batch.num_groups,
        token_versions=None if batch.token_versions is None else batch.token_versions[idx],
        trainer_version=batch.trainer_version,
        images=None if batch.images is None else [batch.images[int(i)] for i in idx.tolist()],
    )
