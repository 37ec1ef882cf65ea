"""forgerl's default rewards for the arithmetic task, re-implemented with the standard library.

TRL's environment (.venv-trl) has no forgerl, so benchmarks/_trl_side.py scores its
completions with this module. It mirrors, for problems whose answer is an integer (the
arithmetic task's), the default reward block of `forge run`:

    rewards:
    - {name: math_answer, weight: 1.0}   # plugins/forgerl_plugins/rewards/math_answer.py, default options
    - {name: format, weight: 0.2}        # plugins/forgerl_plugins/rewards/format.py, default options

- math_answer: the last non-empty ``<answer>…</answer>`` (case-insensitive, across lines)
  holds the answer, and its last number must equal the reference (1.0); without such a
  tag, a right last number anywhere in the text earns 0.5; otherwise 0.
- format: 1.0 when the text contains ``<answer>`` + non-blank content + ``</answer>``.

Equality: forgerl compares the two numbers with math-verify. For the strings a number
regex can return (digits, thousands separators removed, an optional sign and decimals)
and an integer reference, that is exact numeric equality of ASCII numbers, which Decimal
gives here.
benchmarks/vs_trl.py checks this module against forgerl's reward classes on a few hundred
strings and on every completion TRL produced in the run.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

TAG = "answer"
FALLBACK_CREDIT = 0.5
WEIGHTS = {"math_answer": 1.0, "format": 0.2}

# The same number pattern as forgerl's math_answer: a minus sign counts only when it does
# not follow a word character or a dot.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?")
_TAGGED = re.compile(rf"<{TAG}>(.*?)</{TAG}>", re.DOTALL | re.IGNORECASE)
_FORMAT = re.compile(rf"<{TAG}>\s*[^<\s][^<]*</{TAG}>", re.DOTALL)


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(reference: str, number: str | None) -> bool:
    # \d also matches other scripts' digits, which Decimal reads and math-verify does not.
    if number is None or not number.isascii():
        return False
    try:
        return Decimal(number) == Decimal(reference)
    except InvalidOperation:
        return False


def math_answer(text: str, reference: str) -> tuple[float, bool, bool]:
    """(value, correct, tagged) of forgerl's math_answer for an integer reference."""
    spans = [span for span in _TAGGED.findall(text) if span.strip()]
    if spans:
        correct = _same_number(reference, last_number(spans[-1]))
        return (1.0 if correct else 0.0), correct, True
    correct = _same_number(reference, last_number(text))
    return (FALLBACK_CREDIT if correct else 0.0), correct, False


def format_reward(text: str) -> float:
    return 1.0 if _FORMAT.search(text) else 0.0


def total_reward(text: str, reference: str) -> float:
    """The reward forgerl trains on: the weighted sum of both."""
    return WEIGHTS["math_answer"] * math_answer(text, reference)[0] + WEIGHTS["format"] * format_reward(text)
