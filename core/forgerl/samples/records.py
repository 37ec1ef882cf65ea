"""The sample record: what one completion (or trajectory) was, how it scored and why.

One JSON object per line. Readers ignore keys they do not know (a newer writer may add
some); a line that is not a record is skipped by :mod:`forgerl.samples.reader`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: ``kind``: a training step's sample, or a held-out evaluation's.
KINDS = ("train", "eval")


@dataclass
class SampleRecord:
    """One sample. ``step``: the training steps done when it was made (a training sample
    belongs to the step that trains on it, 1 for the first; an evaluation before training
    is step 0). ``prompt`` is the text of the prompt tokens; ``messages`` the whole
    trajectory as chat messages when an environment ran it. ``advantage`` is None for a
    sample that was not trained on (dropped as stale); ``error`` says why a reward or the
    environment failed the sample."""

    kind: str
    step: int
    policy_version: int | None = None
    problem_id: str | None = None
    group: int | None = None
    index: int | None = None
    source: str | None = None
    prompt: str = ""
    messages: list[dict[str, Any]] | None = None
    completion: str = ""
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    advantage: float | None = None
    correct: bool | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_json(self) -> str:
        """One line of JSON (no newline); non-finite floats become null."""
        return json.dumps(_finite(asdict(self)), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str | bytes) -> SampleRecord:
        """The record a line holds; ValueError when it is not one."""
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object: {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleRecord:
        """The record of a decoded line; ValueError when a required key is missing or mistyped."""
        kind, step = data.get("kind"), data.get("step")
        if kind not in KINDS:
            raise ValueError(f"kind is {kind!r}, not one of {', '.join(KINDS)}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step is {step!r}, not a non-negative integer")
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        if not isinstance(record.components, dict):
            raise ValueError(f"components is {type(record.components).__name__}, not an object")
        if record.messages is not None and not isinstance(record.messages, list):
            raise ValueError(f"messages is {type(record.messages).__name__}, not a list")
        return record

    @property
    def failed(self) -> bool:
        """Whether a reward or the environment failed the sample."""
        return self.error is not None


def message_text(m: Any) -> str:
    """A recorded message's text to show or search: its content, then each tool call it
    makes (an agent's, in OpenAI's shape) as JSON on a line of its own."""
    if not isinstance(m, dict):
        return str(m)
    content = m.get("content")
    text = content if isinstance(content, str) else "" if content is None else str(content)
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        text = "\n".join([text, *(json.dumps(c, ensure_ascii=False) for c in calls)]).strip("\n")
    return text


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
