"""How stale a sample is, counted per token, and what the loop does with stale ones.

A completion that ran across a weight update (the vllm generator's update policy ``keep``)
or a multi-turn trajectory holds tokens of several policy versions (``Completion.versions``).
Its age is that of its *oldest* token: trained at version ``v``, a token sampled by version
``u`` is ``v - u`` versions old, and ``loop.max_staleness = S`` allows ages up to ``S``.
``loop.stale_samples`` says what happens to a sample whose oldest tokens are older:

- ``drop``: the whole sample goes (counted in ``samples/dropped_stale``);
- ``mask``: its too-old tokens leave the loss (counted in ``staleness/tokens_masked``) but
  stay in the sequence as context, so the tokens of allowed versions are still trained on
  in the context they were sampled in. A sample left with no trainable token is dropped.

The masking itself happens in :func:`forgerl.runloop.batching.collate` (given the oldest allowed
version), which builds the loss mask; here only the decisions and their counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from forgerl.types import Completion, Episode

StaleSamples = Literal["drop", "mask"]


def token_versions(completion: Completion) -> list[int]:
    """The version that sampled each token: ``versions`` where the completion has them,
    else its single ``policy_version`` for every token."""
    if completion.versions is not None:
        return list(completion.versions)
    return [completion.policy_version] * len(completion.token_ids)


def oldest_version(completion: Completion) -> int:
    """The version of the completion's oldest token (its ``policy_version`` when it has no
    tokens or no per-token versions), from which its staleness counts."""
    if completion.versions:
        return min(completion.versions)
    return completion.policy_version


def _sampled(completion: Completion) -> list[bool]:
    """Which tokens were sampled (a trajectory's environment tokens were not)."""
    if completion.mask is None:
        return [True] * len(completion.token_ids)
    return [m != 0 for m in completion.mask]


@dataclass
class StaleFilter:
    """The samples to train on and what staleness took away: whole samples dropped, and
    (under ``mask``) sampled tokens of kept samples left out of the loss."""

    kept: list[Episode]
    dropped: int
    tokens_masked: int


def filter_stale(
    episodes: Sequence[Episode], *, min_version: int | None, mode: StaleSamples
) -> StaleFilter:
    """Apply ``loop.stale_samples`` with ``min_version`` the oldest version allowed
    (trainer version - ``max_staleness``); None: nothing is stale (a generator that serves
    fixed weights, where nothing newer exists to sample)."""
    if min_version is None:
        return StaleFilter(list(episodes), 0, 0)
    kept: list[Episode] = []
    masked = 0
    for e in episodes:
        c = e.completion
        if oldest_version(c) >= min_version:
            kept.append(e)
            continue
        if mode == "drop":
            continue
        allowed = stale = 0
        for version, sampled in zip(token_versions(c), _sampled(c)):
            if sampled:
                if version >= min_version:
                    allowed += 1
                else:
                    stale += 1
        if allowed:  # something left to learn from; its stale tokens stay as context
            kept.append(e)
            masked += stale
    return StaleFilter(kept, len(episodes) - len(kept), masked)


def age_counts(counts: Mapping[int, int], always: int) -> dict[int, int]:
    """Trained tokens per age (versions older than the trainer), sorted by age, with every
    age from 0 to ``always`` (0 when none, so the metrics keep their keys from step to
    step) and any other age present."""
    full = dict.fromkeys(range(always + 1), 0)
    full.update(counts)
    return {a: int(n) for a, n in sorted(full.items())}
