"""A teacher is bounded like every reward: a hung one times out, a dead one fails its
samples, a sequence it cannot score fails alone, and what it answers is checked. The
step's batch then leaves failed samples out of the loss, and a trajectory's environment
tokens get no advantage."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from forgerl.algorithms import AlgorithmConfig  # noqa: E402
from forgerl.configuration.sections import DistillConfig  # noqa: E402
from forgerl.distill import Teacher, TeacherRequest, TeacherScores  # noqa: E402
from forgerl.distill.scoring import TeacherScorer  # noqa: E402
from forgerl.runloop.distill_batch import distill_batch, teacher_requests  # noqa: E402
from forgerl.types import Completion, Episode, Problem  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

POISON = 13  # a token id the fake teacher refuses, as a server refuses a sequence


class Fake(Teacher):
    """Scores token t with -t/100 (so the values say which token they belong to) and
    names token+1 its top-1; refuses any batch holding POISON."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[int] = []

    async def ascore(self, requests):
        self.calls.append(len(requests))
        if any(POISON in r.token_ids for r in requests):
            raise ConnectionError("the server refused a sequence")
        return [
            TeacherScores([-t / 100 for t in r.token_ids[r.start:]], [t + 1 for t in r.token_ids[r.start:]])
            for r in requests
        ]


def request(*ids: int, start: int = 1) -> TeacherRequest:
    return TeacherRequest(tuple(ids), start)


def test_a_sequence_the_teacher_cannot_score_fails_alone():
    fake = Fake()
    scorer = TeacherScorer(fake, timeout=scaled(10))
    try:
        result = scorer.score([request(1, 2, 3), request(4, POISON), request(5, 6, start=1)])
    finally:
        scorer.close()
    assert result.scores[0] == TeacherScores([-0.02, -0.03], [3, 4])
    assert result.scores[1] is None and "refused" in (result.errors[1] or "")
    assert result.scores[2] == TeacherScores([-0.06], [7])
    assert fake.calls == [3, 1, 1, 1], "one batch, then each sample alone"
    assert result.failed == 1 and result.retried


def test_a_dead_teacher_fails_every_sample_and_never_raises():
    class Dead(Teacher):
        async def ascore(self, requests):
            raise ConnectionRefusedError(111, "Connection refused")

    scorer = TeacherScorer(Dead(), timeout=scaled(10))
    try:
        result = scorer.score([request(1, 2), request(3, 4)])
    finally:
        scorer.close()
    assert result.scores == [None, None] and all("refused" in e for e in result.errors)
    assert scorer.failures == 2


def test_a_hung_teacher_times_out_without_waiting_for_its_thread():
    release = threading.Event()

    class Hung(Teacher):
        async def ascore(self, requests):
            await asyncio.to_thread(release.wait)  # a forward pass that never returns
            return []

    scorer = TeacherScorer(Hung(), timeout=0.5)
    try:
        start = time.monotonic()
        result = scorer.score([request(1, 2), request(3, 4)])
        took = time.monotonic() - start
    finally:
        release.set()
        scorer.close()
    assert result.scores == [None, None] and "0.5 s" in (result.errors[0] or "")
    assert result.reasons == {"timeout": 2} and not result.retried, "a timed-out batch is not retried"
    assert took < scaled(10), took


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (TeacherScores([-0.1]), "1 logprobs for 2 tokens"),
        (TeacherScores([-0.1, float("nan")]), "not a finite number"),
        (TeacherScores([-0.1, float("-inf")]), "not a finite number"),
        (TeacherScores([-0.1, 0.7]), "not a finite number <= 0"),
        (TeacherScores([-0.1, -0.2], [1]), "1 top-1 tokens"),
        ({"logprobs": [-0.1, -0.2]}, "not TeacherScores"),
    ],
)
def test_an_answer_that_is_not_one_fails_its_sample(answer, why):
    class Liar(Teacher):
        async def ascore(self, requests):
            return [answer, TeacherScores([-1.0, -1.0])]

    scorer = TeacherScorer(Liar(), timeout=scaled(10))
    try:
        result = scorer.score([request(1, 2, 3), request(4, 5, 6)])
    finally:
        scorer.close()
    assert result.scores[0] is None and why in (result.errors[0] or ""), result.errors
    assert result.scores[1] == TeacherScores([-1.0, -1.0])


def test_a_wrong_count_of_answers_fails_the_batch_then_each_sample_alone():
    class Short(Teacher):
        async def ascore(self, requests):
            return [TeacherScores([-1.0])] * max(1, len(requests) - 1)

    scorer = TeacherScorer(Short(), timeout=scaled(10))
    try:
        result = scorer.score([request(1, 2), request(3, 4)])
    finally:
        scorer.close()
    assert result.scores == [TeacherScores([-1.0]), TeacherScores([-1.0])] and result.retried


# ---------------------------------------------------------------- the step's batch


def episode(group: int, prompt: list[int], tokens: list[int], logprobs: list[float], reward: float,
            mask: list[int] | None = None) -> Episode:
    completion = Completion(tokens, logprobs, "stop", 0, mask=mask, versions=None if mask is None else [0] * len(tokens))
    return Episode(Problem("p", "q"), group, prompt, completion, reward)


def batch_of(episodes, teacher, **distill):
    scorer = TeacherScorer(teacher, timeout=scaled(10))
    try:
        return distill_batch(episodes, AlgorithmConfig(), DistillConfig(**distill), scorer, max_tokens=16, pad_id=0)
    finally:
        scorer.close()


def test_a_trajectory_is_scored_whole_and_only_its_sampled_tokens_get_advantages():
    # Prompt [1, 2]; assistant 20 21, environment 30 31, assistant 22.
    trajectory = episode(0, [1, 2], [20, 21, 30, 31, 22], [-1.0, -0.5, 0.0, 0.0, -2.0], 1.0, mask=[1, 1, 0, 0, 1])
    plain = episode(0, [1, 2], [40, 41], [-0.1, -0.2], 0.0)
    assert teacher_requests([trajectory]) == [TeacherRequest((1, 2, 20, 21, 30, 31, 22), 2)], (
        "the teacher sees the whole trajectory, environment tokens included"
    )
    prepared = batch_of([trajectory, plain], Fake())
    adv = prepared.batch.advantages
    assert adv.shape == prepared.batch.input_ids.shape, "per-token advantages [B, T]"
    # A_t = log p_teacher - log p_student = -token/100 - logprob, at sampled tokens only.
    expected_row0 = [0, 0, -0.20 + 1.0, -0.21 + 0.5, 0, 0, -0.22 + 2.0]
    assert adv[0].tolist() == pytest.approx(expected_row0)
    assert adv[1, :4].tolist() == pytest.approx([0, 0, -0.40 + 0.1, -0.41 + 0.2])
    metrics = prepared.metrics
    assert metrics["distill/scored_tokens"] == 5 and metrics["distill/failed"] == 0
    # The fake's top-1 is token+1: never the sampled token.
    assert metrics["distill/agreement"] == 0.0
    assert metrics["distill/reverse_kl"] == pytest.approx(-sum([*expected_row0[2:], -0.30, -0.21]) / 5)


def test_a_sample_the_teacher_failed_trains_on_nothing_and_the_others_as_usual():
    good = episode(0, [1, 2], [20, 21], [-1.0, -1.0], 1.0)
    poisoned = episode(0, [1, 2], [POISON, 21], [-1.0, -1.0], 0.0)
    prepared = batch_of([good, poisoned], Fake())
    batch = prepared.batch
    assert prepared.metrics["distill/failed"] == 1
    assert batch.loss_mask[1].sum() == 0 and (batch.advantages[1] == 0).all(), "the failed sample left the loss"
    assert batch.loss_mask[0].sum() == 2 and (batch.advantages[0, 2:4] != 0).all()


def test_groups_with_equal_rewards_are_kept_and_rewards_mix_by_their_weight():
    # One group, equal rewards: GRPO would filter it out (nothing to learn from rewards).
    a = episode(0, [1, 2], [20], [-1.0], 1.0)
    b = episode(0, [1, 2], [21], [-1.0], 1.0)
    c = episode(1, [1, 2], [22], [-1.0], 1.0)
    d = episode(1, [1, 2], [23], [-1.0], 0.0)
    prepared = batch_of([a, b, c, d], Fake(), reward_weight=2.0)
    assert prepared.batch.size == 4 and prepared.filtered_groups == 0
    adv = prepared.batch.advantages[:, 2].tolist()
    group = [0.0, 0.0, 1 / 2**0.5, -1 / 2**0.5]  # group-relative: mean 0.5, std (unbiased) 0.707
    kl = [-0.20 + 1.0, -0.21 + 1.0, -0.22 + 1.0, -0.23 + 1.0]
    assert adv == pytest.approx([k + 2.0 * g for k, g in zip(kl, group)], abs=1e-5)
