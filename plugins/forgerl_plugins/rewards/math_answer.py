"""The ``math_answer`` reward: is the final answer mathematically equal to the reference?

The answer is read from the last ``<tag>…</tag>`` of the completion and compared with
the problem's reference by math-verify (so ``0.5`` equals ``\\frac{1}{2}`` and ``42.0``
equals ``42``). A completion without the tag can still earn ``fallback_credit`` when the
last number it writes is right: a small model rarely uses the tag at first, and without
that partial credit GRPO sees reward 0 everywhere and learns nothing.

A problem whose metadata says ``answer_type: integer`` (the arithmetic task's do) is
answered by the last number of the answer, so that restating the question ("17 + 25",
which math-verify evaluates to 42) earns nothing.

math-verify guards parsing and comparison with ``signal.alarm``, which only works in the
main thread; the scoring engine may call rewards from threads (and enforces its own
timeout by killing the worker process), so this reward disables math-verify's
(``parsing_timeout=None``, ``timeout_seconds=None``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from pydantic import Field

from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput, RewardResult

# A number, with thousands separators and decimals; a minus sign counts only when it does
# not follow a word ("17-25" ends with 25, "x = -8" with -8).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?")


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; the scoring engine enforces one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (commas removed), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _parse(text: str) -> list[Any]:
    # Imported here: the registry imports this module for every `forge` command, and
    # math-verify brings in sympy.
    from math_verify import parse

    return parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str) -> tuple[Any, ...]:
    # References are often bare LaTeX ("\frac{1}{2}"); math-verify finds LaTeX inside $…$.
    parsed = _parse(answer) or _parse(f"${answer}$")
    return tuple(parsed)


def _equal(reference: str, answer: str) -> bool:
    gold = list(_parse_reference(reference))
    if not gold or not answer.strip():
        return False
    pred = _parse(answer)
    if not pred:
        return False
    from math_verify import verify

    return bool(verify(gold, pred, timeout_seconds=None))


class MathAnswerReward(Reward):
    name = "math_answer"
    description = "the answer equals the reference (math-verify)"
    requires = ("math_verify",)

    class Options(OptionsModel):
        tag: str | None = Field(
            "answer",
            pattern=r"^[A-Za-z_][\w-]*$",
            description="Read the answer inside the last <tag></tag>; None: the whole text.",
        )
        fallback_last_number: bool = Field(
            True, description="Without a tagged answer, compare the last number in the text."
        )
        fallback_credit: float = Field(
            0.5, ge=0, le=1, description="Credit for a right answer found only by the fallback."
        )

    def __init__(self, options: Options):
        # A missing math-verify fails here, when the reward is built, as when it was
        # imported at the top of this module (not at the first sample scored).
        import math_verify  # noqa: F401

        self.options = options
        self._tag = (
            re.compile(
                rf"<{re.escape(options.tag)}>(.*?)</{re.escape(options.tag)}>", re.DOTALL | re.IGNORECASE
            )
            if options.tag
            else None
        )

    def score(self, sample: RewardInput) -> RewardResult:
        reference = sample.problem.answer
        text = sample.completion_text
        integer = sample.problem.metadata.get("answer_type") == "integer"
        o = self.options

        if self._tag is None:
            correct = self._check(reference, text, integer)
            return _result(1.0 if correct else 0.0, correct, tagged=False)

        # An empty tag is no answer: a model echoing "<answer></answer>" from the prompt
        # before answering in plain text still gets the fallback's credit.
        spans = [span for span in self._tag.findall(text) if span.strip()]
        if spans:
            correct = self._check(reference, spans[-1], integer)
            return _result(1.0 if correct else 0.0, correct, tagged=True)

        if o.fallback_last_number:
            number = last_number(text)
            correct = number is not None and _equal(reference, number)
            return _result(o.fallback_credit if correct else 0.0, correct, tagged=False)
        return _result(0.0, False, tagged=False)

    @staticmethod
    def _check(reference: str, answer: str, integer: bool) -> bool:
        if integer:
            number = last_number(answer)
            return number is not None and _equal(reference, number)
        return _equal(reference, answer)


def _result(value: float, correct: bool, *, tagged: bool) -> RewardResult:
    return RewardResult(value=float(value), components={"correct": float(correct), "tagged": float(tagged)})
