"""The built-in rewards: math_answer (math-verify) and format (regex)."""

from __future__ import annotations

import threading

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput, RewardResult
from forgerl_plugins.rewards.format import FormatReward
from forgerl_plugins.rewards.math_answer import MathAnswerReward, last_number
from tests.helpers.timing import scaled


def sample(text, answer="42", **metadata):
    return RewardInput(
        problem=Problem(id="p", prompt="What is 17 + 25?", answer=answer, metadata=metadata),
        completion_text=text,
    )


def math(**kw):
    return MathAnswerReward(MathAnswerReward.Options(**kw))


def scored(reward, text, answer="42", **metadata):
    result = reward.score(sample(text, answer, **metadata))
    assert isinstance(result, RewardResult), result
    return result.value, dict(result.components)


# ----------------------------------------------------------------- math_answer


@pytest.mark.parametrize(
    "text, value, correct, tagged",
    [
        ("17 + 25 = 42. <answer>42</answer>", 1.0, 1.0, 1.0),
        ("<answer> 42 </answer>", 1.0, 1.0, 1.0),
        ("<answer>The answer is 42.</answer>", 1.0, 1.0, 1.0),
        ("<answer>42.0</answer>", 1.0, 1.0, 1.0),
        ("<answer>41</answer> no wait <answer>42</answer>", 1.0, 1.0, 1.0),  # the last tag counts
        ("<answer>42</answer> no wait <answer>41</answer>", 0.0, 0.0, 1.0),
        ("<answer>41</answer> but really 42", 0.0, 0.0, 1.0),  # a wrong tag is not rescued
        ("Give it inside <answer></answer>: 42", 0.5, 1.0, 0.0),  # an empty tag is no answer
        ("17 + 25 = 42", 0.5, 1.0, 0.0),  # fallback: the last number, partial credit
        ("It is 42, I think.", 0.5, 1.0, 0.0),
        ("42 or maybe 43", 0.0, 0.0, 0.0),
        ("I do not know", 0.0, 0.0, 0.0),
        ("", 0.0, 0.0, 0.0),
    ],
)
def test_math_answer_tag_and_fallback(text, value, correct, tagged):
    assert scored(math(), text) == (value, {"correct": correct, "tagged": tagged}), text


def test_math_answer_compares_mathematically():
    r = math()
    assert scored(r, "<answer>0.5</answer>", answer="\\frac{1}{2}")[0] == 1.0
    assert scored(r, "<answer>$\\frac{1}{2}$</answer>", answer="0.5")[0] == 1.0
    assert scored(r, "<answer>1/3</answer>", answer="0.5")[0] == 0.0
    assert scored(r, "<answer>-8</answer>", answer="-8")[0] == 1.0
    assert scored(r, "<answer>1,000</answer>", answer="1000")[0] == 1.0


def test_math_answer_integer_problems_need_a_number_not_the_question():
    r = math()
    # math-verify evaluates "17 + 25" to 42: fine for expressions, a hack for arithmetic.
    assert scored(r, "<answer>17 + 25</answer>")[0] == 1.0
    assert scored(r, "<answer>17 + 25</answer>", answer_type="integer")[0] == 0.0
    assert scored(r, "<answer>17 + 25 = 42</answer>", answer_type="integer")[0] == 1.0
    assert scored(r, "<answer>42</answer>", answer_type="integer")[0] == 1.0
    assert scored(r, "17 + 25", answer_type="integer")[0] == 0.0


def test_math_answer_options():
    assert scored(math(fallback_credit=0.25), "so 42")[0] == 0.25
    assert scored(math(fallback_last_number=False), "so 42") == (0.0, {"correct": 0.0, "tagged": 0.0})
    assert scored(math(tag="final"), "<final>42</final>")[0] == 1.0
    assert scored(math(tag="final"), "<answer>42</answer>")[0] == 0.5  # only the fallback sees it
    # tag None: the whole text is the answer, full credit.
    assert scored(math(tag=None), "The answer is $42$")[0] == 1.0


def test_math_answer_runs_in_worker_threads():
    # math-verify's default timeouts use signal.alarm, which fails outside the main thread.
    results, errors = [], []

    def work():
        try:
            results.append(math().score(sample("<answer>\\frac{84}{2}</answer>")).value)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(30))
    assert not errors, errors
    assert results == [1.0] * 4


def test_last_number():
    assert last_number("17 + 25 = 42.") == "42"
    assert last_number("17-25") == "25"
    assert last_number("x = -8") == "-8"
    assert last_number("pi is 3.14") == "3.14"
    assert last_number("1,234 apples") == "1234"
    assert last_number("none") is None


# ---------------------------------------------------------------------- format


def fmt(**kw):
    return FormatReward(FormatReward.Options(**kw))


def test_format_default_wants_a_non_empty_answer_tag():
    r = fmt()
    assert r.score(sample("think...\n<answer>\n42\n</answer> done")) == 1.0
    assert r.score(sample("<answer></answer>")) == 0.0
    assert r.score(sample("<answer>  </answer>")) == 0.0
    assert r.score(sample("the answer is 42")) == 0.0


def test_format_modes():
    assert fmt(pattern=r"\d+", mode="search").score(sample("is 42")) == 1.0
    assert fmt(pattern=r"\d+", mode="fullmatch").score(sample("is 42")) == 0.0
    assert fmt(pattern=r"a.*b", mode="fullmatch").score(sample("a\n\nb")) == 1.0  # DOTALL


def test_format_bad_pattern_is_refused_when_validating():
    with pytest.raises(Exception, match="not a valid regular expression"):
        FormatReward.Options(pattern="(unclosed")


def test_rewards_are_registered_and_built_by_name():
    registry = build_registry()
    r = registry.require("reward", "math_answer").build({"fallback_credit": 0.1})
    assert r.score(sample("so 42")).value == 0.1
    assert registry.require("reward", "format").build({}).score(sample("<answer>1</answer>")) == 1.0
