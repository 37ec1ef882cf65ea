"""The Teacher interface: the teacher's log-probability of each token the student sampled.

A teacher backend (kind ``teacher``, registered with ``forge_teachers``, built once on
trainer rank 0 as ``Class(options, *, context)``) answers :meth:`Teacher.ascore` for a
list of sequences: each is the prompt's token ids followed by the student's completion (a
trajectory: every token after the first prompt, the environment's tokens included, so
each sampled token is scored in the context of the whole conversation so far). Token ids
cross the interface, never text: teacher and student share one tokenizer (``forge run``
refuses a pair that does not, :mod:`forgerl.distill.tokenizers`).

The loop (:mod:`forgerl.distill.scoring`) bounds each call by ``distill.timeout``, and a
call that fails is retried sample by sample, so one sequence the teacher cannot score
fails alone. A backend batches as it likes and must not block the event loop (a forward
pass runs on a worker thread; an HTTP request is awaited or threaded).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TeacherRequest:
    """One sequence to score: ``token_ids`` is the prompt followed by the completion, and
    the teacher scores every token from index ``start`` (the first completion token) on."""

    token_ids: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        if not 1 <= self.start <= len(self.token_ids):
            # Token 0 has no context to be predicted from: a prompt of at least one token.
            raise ValueError(f"start must be in [1, {len(self.token_ids)}], got {self.start}")

    @property
    def scored(self) -> int:
        """How many tokens the teacher scores."""
        return len(self.token_ids) - self.start


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's answer for one :class:`TeacherRequest`: ``logprobs[i]`` is the
    natural-log probability the teacher gives ``token_ids[start + i]`` after the tokens
    before it (at temperature 1). ``top1[i]``, where the teacher gives it, is the token the
    teacher finds most likely at that position (for the agreement metric); None if not."""

    logprobs: list[float]
    top1: list[int] | None = None


class Teacher(abc.ABC):
    """A model that scores the student's samples (see the module docstring)."""

    #: The name users select the backend by (``distill.teacher.name``).
    name: str = ""

    @abc.abstractmethod
    async def ascore(self, requests: Sequence[TeacherRequest]) -> list[TeacherScores]:
        """One :class:`TeacherScores` per request, in order. Called on trainer rank 0 from
        the loop's scoring event loop, once per step with the step's samples (and again per
        sample after a failure); raise for a failure (the caller fails the samples, never
        the run). Must not block the event loop."""

    def close(self) -> None:  # noqa: B027 - optional: most teachers hold nothing to release
        """Release what the teacher holds (a model, connections). Called once, at the end."""
