"""Scoring a step's samples with the teacher, bounded like every reward.

:meth:`TeacherScorer.score` sends every sample of a step to the teacher in one call,
under ``distill.timeout`` seconds. When that call raises (a server that refused one
sequence, a connection that broke), each sample is sent again alone, concurrently, each
under the timeout: a sequence the teacher cannot score fails alone, the others are scored.
A call that timed out is not retried (a hung teacher would only hang again): its samples
fail. An answer that is not what was asked (a wrong count, a non-finite or positive
logprob) fails its sample too. The run never fails because of the teacher: a failed
sample is left out of the step's loss (:mod:`forgerl.runloop.distill_batch`) and counted.

The scorer keeps one event loop of its own, run in the caller's thread (the loop's main
thread) for the length of each call: a teacher's worker thread that outlives a timeout is
abandoned, not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from forgerl.teacher import Teacher, TeacherRequest, TeacherScores

log = logging.getLogger("forgerl.distill")

#: A logprob above this is not one (float rounding gives a little above 0 at certainty).
MAX_LOGPROB = 1e-3
#: Error messages kept per failed sample (a server's answer may be long).
MAX_ERROR_CHARS = 300


@dataclass
class TeacherRound:
    """The outcome of one :meth:`TeacherScorer.score`: per request its scores or None
    (failed), and why it failed."""

    scores: list[TeacherScores | None]
    errors: list[str | None]
    seconds: float = 0.0
    retried: bool = False
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(s is None for s in self.scores)


class TeacherScorer:
    """Calls a :class:`Teacher` with timeouts and per-sample failure (module docstring)."""

    def __init__(self, teacher: Teacher, *, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.teacher = teacher
        self.timeout = float(timeout)
        self._loop = asyncio.new_event_loop()
        #: Failed samples over the run (the reasons go to the log).
        self.failures = 0

    def score(self, requests: Sequence[TeacherRequest]) -> TeacherRound:
        """Scores of every request (blocking); never raises because of the teacher."""
        start = time.perf_counter()
        if not requests:
            return TeacherRound([], [], 0.0)
        result = self._loop.run_until_complete(self._score(list(requests)))
        result.seconds = time.perf_counter() - start
        if result.failed:
            self.failures += result.failed
            first = next(e for e in result.errors if e is not None)
            log.warning("the teacher failed %d of %d samples (first: %s)", result.failed, len(requests), first)
        return result

    async def _score(self, requests: list[TeacherRequest]) -> TeacherRound:
        try:
            answers = await self._call(requests)
        except TimeoutError:
            why = f"the teacher did not answer within {self.timeout:g} s (distill.timeout)"
            return TeacherRound([None] * len(requests), [why] * len(requests), reasons={"timeout": len(requests)})
        except Exception as exc:  # noqa: BLE001 - a teacher's failure fails samples, not the run
            if len(requests) == 1:
                return TeacherRound([None], [_describe(exc)], reasons={"error": 1})
            # Which sample was it? Each alone: the ones the teacher can score are scored.
            alone = await asyncio.gather(*(self._score([r]) for r in requests))
            merged = TeacherRound(
                [a.scores[0] for a in alone], [a.errors[0] for a in alone], retried=True
            )
            for a in alone:
                for reason, count in a.reasons.items():
                    merged.reasons[reason] = merged.reasons.get(reason, 0) + count
            return merged
        scores: list[TeacherScores | None] = []
        errors: list[str | None] = []
        for request, answer in zip(requests, answers, strict=True):
            problem = check_scores(request, answer)
            scores.append(None if problem else answer)
            errors.append(problem)
        bad = sum(e is not None for e in errors)
        return TeacherRound(scores, errors, reasons={"invalid": bad} if bad else {})

    async def _call(self, requests: list[TeacherRequest]) -> list[TeacherScores]:
        answers = await asyncio.wait_for(self.teacher.ascore(requests), self.timeout)
        if not isinstance(answers, list) or len(answers) != len(requests):
            got = len(answers) if isinstance(answers, list) else type(answers).__name__
            raise ValueError(f"the teacher answered {got} results for {len(requests)} sequences")
        return answers

    def close(self) -> None:
        """Close the teacher, then the event loop. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self.teacher.close()
        finally:
            self._loop.close()


def check_scores(request: TeacherRequest, answer: object) -> str | None:
    """Why ``answer`` is not a valid answer to ``request`` (None: it is). A teacher is
    another program, possibly another machine: its numbers are checked, not trusted."""
    if not isinstance(answer, TeacherScores):
        return f"the teacher answered a {type(answer).__name__}, not TeacherScores"
    if len(answer.logprobs) != request.scored:
        return f"the teacher gave {len(answer.logprobs)} logprobs for {request.scored} tokens"
    for value in answer.logprobs:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value > MAX_LOGPROB:
            return f"the teacher gave a logprob that is not a finite number <= 0: {value!r}"
    if answer.top1 is not None and len(answer.top1) != request.scored:
        return f"the teacher gave {len(answer.top1)} top-1 tokens for {request.scored} tokens"
    return None


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not text.startswith(type(exc).__name__):
        text = f"{type(exc).__name__}: {text}"
    return text[:MAX_ERROR_CHARS]
