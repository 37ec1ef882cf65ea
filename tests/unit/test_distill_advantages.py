"""On-policy distillation's per-token advantages against a hand computation, and the
direction they move the student: toward the teacher, never away."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from forgerl.algorithms import AlgorithmConfig, policy_loss  # noqa: E402
from forgerl.distill.advantages import agreement, distill_advantages, reverse_kl_mean  # noqa: E402

# Two rows: a prompt token (position 0), then sampled tokens; row 1 is one token shorter.
STUDENT = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.25, -3.0, 0.0]])
TEACHER = torch.tensor([[0.0, -0.5, -4.0, -0.5], [0.0, -1.25, -1.0, 0.0]])
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)


def test_each_token_is_rewarded_by_how_much_more_the_teacher_likes_it():
    adv = distill_advantages(STUDENT, TEACHER, MASK)
    # By hand: A_t = log p_teacher - log p_student on sampled tokens, 0 elsewhere.
    expected = torch.tensor([[0.0, 0.5, -2.0, 0.0], [0.0, -1.0, 2.0, 0.0]])
    assert torch.equal(adv, expected), adv


def test_weights_clip_and_the_reward_mix_by_hand():
    reward = torch.tensor([1.0, -2.0])  # the group-relative advantage of each row
    adv = distill_advantages(STUDENT, TEACHER, MASK, kl_weight=0.5, kl_clip=1.5, reward_advantages=reward,
                             reward_weight=0.25)
    # kl terms (student - teacher): row 0 [-0.5, 2 -> 1.5 clipped, 0], row 1 [1, -2 -> -1.5 clipped]
    expected = torch.tensor([
        [0.0, -0.5 * -0.5 + 0.25, -0.5 * 1.5 + 0.25, 0.0 + 0.25],
        [0.0, -0.5 * 1.0 - 0.5, -0.5 * -1.5 - 0.5, 0.0],
    ])
    assert torch.allclose(adv, expected), adv


def test_padding_and_a_failed_teachers_garbage_never_leak():
    teacher = TEACHER.clone()
    teacher[1, 3] = float("nan")  # padding
    student = STUDENT.clone()
    student[0, 0] = float("-inf")  # the prompt position
    adv = distill_advantages(student, teacher, MASK, reward_advantages=torch.zeros(2), reward_weight=1.0)
    assert torch.isfinite(adv).all() and adv[1, 3] == 0 and adv[0, 0] == 0


def test_reverse_kl_is_the_mean_of_student_minus_teacher_over_sampled_tokens():
    # (-0.5 + 2 + 0 + 1 - 2) / 5
    assert reverse_kl_mean(STUDENT, TEACHER, MASK) == pytest.approx(0.1)
    assert reverse_kl_mean(STUDENT, STUDENT, MASK) == 0.0
    assert reverse_kl_mean(STUDENT, TEACHER, torch.zeros_like(MASK)) == 0.0


def test_agreement_counts_sampled_tokens_that_are_the_teachers_first_choice():
    sampled = torch.tensor([[5, 6, 7, 8], [5, 9, 9, 0]])
    top1 = torch.tensor([[1, 6, 2, 8], [1, -1, 9, 3]])  # -1: the teacher did not say
    # Counted: row 0 positions 1-3 (6=6, 7!=2, 8=8), row 1 position 2 (9=9): 3 of 4.
    assert agreement(sampled, top1, MASK) == pytest.approx(0.75)
    assert agreement(sampled, torch.full_like(top1, -1), MASK) is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must both be"):
        distill_advantages(STUDENT, TEACHER[:, :3], MASK)
    with pytest.raises(ValueError, match="reward_advantages"):
        distill_advantages(STUDENT, TEACHER, MASK, reward_weight=1.0)
    with pytest.raises(ValueError, match="kl_clip"):
        distill_advantages(STUDENT, TEACHER, MASK, kl_clip=0.0)


def test_one_gradient_step_moves_the_student_toward_the_teacher():
    """The sign that matters: a policy-gradient step on the distillation advantages lowers
    the reverse KL to the teacher. A student over 3 tokens samples every token of a fixed
    batch; the teacher prefers token 2. One SGD step through the real loss (ratio 1)."""
    teacher = torch.log_softmax(torch.tensor([0.0, 0.5, 3.0]), -1)
    logits = torch.zeros(3, requires_grad=True)

    def reverse_kl(logits):
        p = torch.softmax(logits, -1)
        return float((p * (torch.log_softmax(logits, -1) - teacher)).sum())

    before = reverse_kl(logits.detach())
    tokens = torch.tensor([[0, 1, 2, 2, 1, 0]])  # what the student sampled
    student = torch.log_softmax(logits, -1)[tokens]
    mask = torch.ones_like(student)
    adv = distill_advantages(student.detach(), teacher[tokens], mask)
    loss, _ = policy_loss(student, student.detach(), None, adv, mask, AlgorithmConfig(ratio="old"))
    loss.backward()
    with torch.no_grad():
        stepped = logits - 0.5 * logits.grad
    after = reverse_kl(stepped)
    assert after < before, f"a step on the distillation advantages raised the reverse KL: {before} -> {after}"
    assert stepped.argmax().item() == 2, "the student did not move toward the teacher's favourite token"
    assert math.isfinite(after)
