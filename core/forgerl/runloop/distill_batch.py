"""A step's TrainBatch under ``objective: distill``: the teacher's scores of the step's
samples turned into per-token advantages (``TrainBatch.advantages`` ``[B, T]``).

Called by the loop (:meth:`forgerl.runloop.loop.Loop.train_one`) on the samples it is about to
train on (stale ones already dropped, so the teacher never scores what is not trained on):

1. each sample goes to the teacher as its prompt and completion token ids; a trajectory's
   environment tokens go too (context), but get no advantage (the loss mask is 0 there);
2. the batch is built as for GRPO (:func:`forgerl.runloop.batching.prepare_batch`: padding, the
   loss mask, the group-relative reward advantages), but no zero-variance group is
   filtered out: a group whose rewards are all equal still has the teacher's signal;
3. a sample the teacher failed to score is left out of the loss (its loss mask is cleared:
   no distillation signal, and no reward signal either, so one objective is never half
   applied to a sample), and counted in ``distill/failed``;
4. ``A_t = -kl_weight * (log p_student - log p_teacher) + reward_weight * A_group`` per
   sampled token (:func:`forgerl.distill.advantages.distill_advantages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from forgerl.runloop.batching import Prepared, prepare_batch
from forgerl.teacher import TeacherRequest

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.algorithms import AlgorithmConfig
    from forgerl.configuration.sections import DistillConfig
    from forgerl.distill.scoring import TeacherRound, TeacherScorer
    from forgerl.types import Episode

#: The keys :func:`distill_batch` reports each step (``distill/agreement`` only when the
#: teacher gives its top-1 tokens).
METRIC_KEYS = (
    "distill/reverse_kl",
    "distill/agreement",
    "distill/scored_tokens",
    "distill/failed",
    "time/teacher",
)


def teacher_requests(episodes: Sequence[Episode]) -> list[TeacherRequest]:
    """One request per sample: its prompt and completion token ids, scored from the first
    completion token on."""
    return [
        TeacherRequest(tuple(e.prompt_token_ids) + tuple(e.completion.token_ids), len(e.prompt_token_ids))
        for e in episodes
    ]


def distill_batch(
    episodes: Sequence[Episode],
    algorithm: AlgorithmConfig,
    distill: DistillConfig,
    scorer: TeacherScorer,
    *,
    max_tokens: int,
    pad_id: int,
    trainer_version: int | None = None,
    min_version: int | None = None,
) -> Prepared:
    """The step's batch with per-token advantages, its ``distill/*`` metrics in
    ``metrics`` (see the module docstring); what :func:`forgerl.runloop.batching.prepare_batch` is
    to GRPO. Samples with no completion tokens are not sent."""
    episodes = list(episodes)
    to_score = [i for i, e in enumerate(episodes) if e.completion.token_ids and e.prompt_token_ids]
    teacher_round = scorer.score(teacher_requests([episodes[i] for i in to_score]))
    # Every group stays: equal rewards still leave the teacher's signal to learn from.
    kept = algorithm.model_copy(update={"filter_zero_variance": False})
    prepared = prepare_batch(
        episodes, kept, max_tokens=max_tokens, pad_id=pad_id, trainer_version=trainer_version, min_version=min_version
    )
    prepared.metrics = {"time/teacher": teacher_round.seconds, "distill/failed": float(teacher_round.failed)}
    if prepared.batch is not None:
        prepared.metrics.update(_apply(prepared, episodes, to_score, teacher_round, distill))
    return prepared


def _apply(
    prepared: Prepared,
    episodes: list[Episode],
    to_score: list[int],
    teacher_round: TeacherRound,
    distill: DistillConfig,
) -> dict[str, float]:
    import torch

    from forgerl.distill.advantages import agreement, distill_advantages, reverse_kl_mean

    batch = prepared.batch
    assert batch is not None, "called with a batch"
    assert len(prepared.episodes) == len(episodes), "no sample was filtered out of a distillation batch"
    teacher = torch.zeros_like(batch.behaviour_logprobs)
    top1 = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    scored = torch.zeros(batch.size, dtype=torch.bool)
    for row, scores in zip(to_score, teacher_round.scores, strict=True):
        if scores is None:
            continue
        start = len(episodes[row].prompt_token_ids)
        end = start + len(scores.logprobs)
        teacher[row, start:end] = torch.tensor(scores.logprobs, dtype=teacher.dtype)
        if scores.top1 is not None:
            top1[row, start:end] = torch.tensor(scores.top1, dtype=torch.long)
        scored[row] = True
    # A sample the teacher did not score (it failed, or has no tokens) trains on nothing.
    batch.loss_mask = torch.where(scored.unsqueeze(-1), batch.loss_mask, torch.zeros_like(batch.loss_mask))
    mask = batch.loss_mask != 0
    batch.advantages = distill_advantages(
        batch.behaviour_logprobs,
        teacher,
        mask,
        kl_weight=distill.kl_weight,
        kl_clip=distill.kl_clip,
        reward_advantages=batch.advantages,
        reward_weight=distill.reward_weight,
    ).to(torch.float32)
    metrics = {
        "distill/reverse_kl": reverse_kl_mean(batch.behaviour_logprobs, teacher, mask),
        "distill/scored_tokens": float(mask.sum()),
    }
    agreed = agreement(batch.input_ids, top1, mask)
    if agreed is not None:
        metrics["distill/agreement"] = agreed
    return metrics
