"""Sample records as supervised data: rejection-sampling fine-tuning from a run's own samples.

``forge samples RUN_DIR --correct --export sft.jsonl`` writes the samples that pass the
filters as rows of TRL's formats, which ``forge sft --data sft.jsonl`` trains on
(docs/sft.md, "Fine-tune on your own successful samples"):

- a trajectory (a record whose ``messages`` hold the assistant's turns: an environment or
  an agent ran it) is a conversational row, ``{"messages": [...]}``, cut after its last
  assistant turn (an observation after it is nothing to learn);
- a single completion (``messages`` null, or only the chat prompt, as `forge eval` records
  it) is ``{"prompt": ..., "completion": ...}`` with both as strings: the
  record's ``prompt`` is the text of the prompt tokens the generator was given, the chat
  template already applied, so it is tokenised as it is (a string prompt is never put
  through the template again; :func:`forgerl.rollouts.chat_tokens.text_prompt_ids` adds no
  second BOS).

What a model wrote is data: each text is a JSON string of its row, never parsed into
messages or markup (a completion that writes ``<|im_start|>user`` is still the assistant's
text). Records that are not the model's whole text are never trained on: one cut at
``logging.samples.max_chars`` (the writer's cut mark is in it), one with a secret redacted,
one stopped at its token limit (``finish_reason: length``), one a reward or the environment
failed, an empty one. Every row is checked as ``forge sft`` checks a data file
(:func:`forgerl.sft.rows.parse_row`): one it would refuse is left out, counted.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from forgerl.samples.capture import CUT_MARK
from forgerl.samples.records import SampleRecord
from forgerl.samples.redact import REDACTED
from forgerl.sft.rows import DataError, parse_row

#: The mark the capture leaves where the middle of a text was cut (any count).
CUT_MARK_RE = re.compile(re.escape(CUT_MARK).replace(re.escape("{n}"), r"\d+"))


@dataclass
class Export:
    """The rows made of some records, and why each record left out was (reason → count)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in self.left_out.most_common())
        return f"{len(self.rows)} rows" + (f" (left out: {reasons})" if reasons else "")


def sft_rows(
    records: Iterable[SampleRecord],
    *,
    correct: bool = False,
    min_reward: float | None = None,
    best_k: int | None = None,
) -> Export:
    """The SFT rows of ``records`` (in their order): only the correct ones (``correct``),
    only those with a reward of at least ``min_reward``, each problem's identical texts
    once, and at most ``best_k`` per problem (the highest rewards; the first written on a
    tie)."""
    if best_k is not None and best_k < 1:
        raise ValueError(f"best_k is {best_k}, not at least 1")
    out = Export()
    kept: list[tuple[SampleRecord, dict[str, Any], str]] = []
    seen: set[tuple[str, str]] = set()
    for r in records:
        why = _left_out(r, correct=correct, min_reward=min_reward)
        if why is None:
            row, why = _row(r)
        if why is not None:
            out.left_out[why] += 1
            continue
        problem = _problem(r)
        text = json.dumps(row.get("messages", row.get("completion")), sort_keys=True, ensure_ascii=False)
        if (problem, text) in seen:
            out.left_out["duplicate"] += 1
            continue
        seen.add((problem, text))
        kept.append((r, row, problem))
    if best_k is not None:
        ranked: dict[str, list[int]] = {}
        for i, (_, _, problem) in enumerate(kept):
            ranked.setdefault(problem, []).append(i)
        best: set[int] = set()
        for indices in ranked.values():
            # sorted() is stable: among equal rewards the first written stays.
            best.update(sorted(indices, key=lambda i: -(kept[i][0].reward or 0.0))[:best_k])
        out.left_out["beyond best-k"] += len(kept) - len(best)
        kept = [k for i, k in enumerate(kept) if i in best]
        if not out.left_out["beyond best-k"]:
            del out.left_out["beyond best-k"]
    out.rows = [row for _, row, _ in kept]
    return out


def _left_out(r: SampleRecord, *, correct: bool, min_reward: float | None) -> str | None:
    """Why ``r`` is not trained on, or None."""
    if r.failed:
        return "failed"
    if correct and r.correct is not True:
        return "not correct" if r.correct is False else "not scored correct or not"
    if min_reward is not None and (r.reward is None or r.reward < min_reward):
        return f"reward below {min_reward:g}"
    if r.finish_reason == "length":
        return "stopped at the token limit"
    texts = [r.prompt, r.completion, *_contents(r.messages)]
    if any(CUT_MARK_RE.search(t) for t in texts):
        return "cut at logging.samples.max_chars"
    if any(REDACTED in t for t in texts):
        return "redacted"
    return None


def _row(r: SampleRecord) -> tuple[dict[str, Any], str | None]:
    """The row of ``r`` and None, or an empty row and why it is not a demonstration."""
    row: dict[str, Any]
    if r.messages is not None and any(isinstance(m, dict) and m.get("role") == "assistant" for m in r.messages):
        if not all(isinstance(m, dict) for m in r.messages):
            return {}, "not a demonstration forge sft reads"
        messages = [dict(m) for m in r.messages]
        while messages and messages[-1].get("role") != "assistant":
            messages.pop()
        if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in messages
                   if m.get("role") == "assistant"):  # fmt: skip
            return {}, "empty"
        row = {"messages": messages}
    else:
        if not r.completion.strip():
            return {}, "empty"
        row = {"prompt": r.prompt, "completion": r.completion}
    try:
        parse_row(row, "sample")
    except DataError:
        return {}, "not a demonstration forge sft reads"
    if r.problem_id is not None:
        row["problem_id"] = r.problem_id
    if r.reward is not None:
        row["reward"] = r.reward
    return row, None


def _contents(messages: list[dict[str, Any]] | None) -> list[str]:
    return [m["content"] for m in messages or [] if isinstance(m, dict) and isinstance(m.get("content"), str)]


def _problem(r: SampleRecord) -> str:
    """What makes two records the same problem: its id, else its prompt."""
    if r.problem_id is not None:
        return "id:" + r.problem_id
    return "prompt:" + r.prompt


def _line(row: dict[str, Any]) -> str:
    """One JSON line. JSON escapes control characters; the line breaks it leaves as they are
    (U+0085, U+2028, U+2029: a line end to ``str.splitlines`` and some JSONL readers) are
    escaped too."""
    text = json.dumps(row, ensure_ascii=False)
    return text.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """``rows`` as JSON Lines at ``path`` (``-``: standard output), written whole or not at
    all (a temporary file renamed into place). Control characters, newlines and quotes of
    a text are escaped by JSON: a row is one line whatever the model wrote."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    text = "".join(_line(row) for row in rows)
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
