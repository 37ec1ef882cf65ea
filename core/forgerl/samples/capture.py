"""A step's episodes (or an evaluation's samples) as sample records: chosen per the
``logging.samples`` options, texts decoded from the tokens, cut to size and redacted."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from forgerl.samples.records import SampleRecord
from forgerl.samples.redact import Redactor, run_keys
from forgerl.types import source_of

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.types import Episode, Problem

log = logging.getLogger("forgerl.samples")

Decode = Callable[[Sequence[int]], str]
#: A record's text longer than this is cut (its head and tail kept) unless options say otherwise.
CUT_MARK = "\n[... {n} characters cut ...]\n"


@dataclass
class Capture:
    """What decides which samples become records and how: ``share`` (each sample kept with
    this probability, drawn from ``seed`` and the step), ``per_step`` (the most records of
    one step or evaluation, whole groups first), ``max_chars`` (per text), the redactor
    and the primary reward's name (for ``correct``)."""

    decode: Decode
    redactor: Redactor
    share: float = 1.0
    per_step: int = 64
    max_chars: int = 8000
    seed: int = 0
    primary_reward: str | None = None

    def choose(self, n: int, step: int, kind: str) -> list[int]:
        """Indices of the ``n`` samples to record, in order."""
        idx = list(range(n))
        if self.share < 1.0:
            rng = random.Random(f"{self.seed}:{kind}:{step}")
            idx = [i for i in idx if rng.random() < self.share]
        return idx[: self.per_step]

    def train(self, episodes: Sequence[Episode], *, step: int, trained: set[int]) -> list[SampleRecord]:
        """Records of one step's episodes; ``trained``: ``id()`` of the episodes trained on
        (the others were dropped as stale: no advantage)."""
        chosen = self.choose(len(episodes), step, "train")
        if not chosen:
            return []
        self.redactor.refresh()
        out = []
        first_group = min(e.group_id for e in episodes)
        within: dict[int, int] = {}
        positions = []
        for e in episodes:
            positions.append(within.get(e.group_id, 0))
            within[e.group_id] = positions[-1] + 1
        prompts: dict[tuple[int, ...], str] = {}  # a group's samples share their prompt: decoded once
        for i in chosen:
            e = episodes[i]
            c = e.completion
            key = tuple(e.prompt_token_ids)
            if key not in prompts:
                prompts[key] = self.decode(e.prompt_token_ids)
            # A trajectory's completion holds environment tokens too: its decoded tokens show them.
            completion = self.decode(c.token_ids) if c.mask is not None else c.text
            out.append(self._clean(SampleRecord(
                kind="train",
                step=step,
                policy_version=c.policy_version,
                problem_id=e.problem.id,
                group=e.group_id - first_group,
                index=positions[i],
                source=_source(e.problem),
                prompt=prompts[key],
                messages=e.messages,
                completion=completion,
                reward=float(e.reward),
                components=dict(e.reward_components),
                advantage=float(e.advantage) if id(e) in trained else None,
                correct=self.correct(e.reward_components),
                finish_reason=c.finish_reason,
                error=e.error if e.error is not None else ("reward failed" if e.reward_failed else None),
                prompt_tokens=len(e.prompt_token_ids),
                completion_tokens=len(c.token_ids),
            )))
        return out

    def evaluation(
        self,
        *,
        step: int,
        policy_version: int | None,
        problems: Sequence[Problem],
        prompt_ids: Sequence[Sequence[int]],
        completions: Sequence[Any],
        scores: Sequence[Any],
        correct: Sequence[float],
        messages: Sequence[list[dict[str, Any]] | None] | None = None,
    ) -> list[SampleRecord]:
        """Records of a held-out evaluation: one sample per problem (``completions``:
        :class:`~forgerl.types.Completion`, ``scores``: :class:`~forgerl.types.RewardResult`)."""
        chosen = self.choose(len(problems), step, "eval")
        if not chosen:
            return []
        self.redactor.refresh()
        out = []
        for i in chosen:
            c, s = completions[i], scores[i]
            text = self.decode(c.token_ids) if getattr(c, "mask", None) is not None else c.text
            out.append(self._clean(SampleRecord(
                kind="eval",
                step=step,
                policy_version=policy_version,
                problem_id=problems[i].id,
                group=None,
                index=i,
                source=_source(problems[i]),
                prompt=self.decode(prompt_ids[i]),
                messages=messages[i] if messages is not None else None,
                completion=text,
                reward=float(s.value),
                components=dict(s.components),
                advantage=None,
                correct=bool(correct[i]),
                finish_reason=c.finish_reason,
                error=s.error if s.failed else None,
                prompt_tokens=len(prompt_ids[i]),
                completion_tokens=len(c.token_ids),
            )))
        return out

    def correct(self, components: Mapping[str, float]) -> bool | None:
        """Whether the primary reward (or an environment's ``correct``) calls it correct; None
        when no component says."""
        p = self.primary_reward
        if p is not None and f"{p}/correct" in components:
            return bool(components[f"{p}/correct"])
        if p is not None and p in components:
            return components[p] >= 1.0
        if "correct" in components:
            return bool(components["correct"])
        return None

    def _clean(self, r: SampleRecord) -> SampleRecord:
        red = self.redactor
        r.prompt = red.text(_cut(r.prompt, self.max_chars))
        r.completion = red.text(_cut(r.completion, self.max_chars))
        if r.error is not None:
            r.error = red.text(_cut(r.error, self.max_chars))
        if r.messages is not None:
            from forgerl.images.parts import without_pixels

            r.messages = [
                red.value({**m, "content": _cut(m["content"], self.max_chars)} if isinstance(m.get("content"), str)
                          else m)
                for m in without_pixels(r.messages) if isinstance(m, dict)
            ]
        r.problem_id = red.text(r.problem_id) if r.problem_id is not None else None
        return r


def _source(problem: Problem) -> str | None:
    """The mixture source a problem came from (docs/data.md), else a ``source`` its own
    metadata names."""
    if not isinstance(problem.metadata, Mapping):
        return None
    source = source_of(problem) or problem.metadata.get("source")
    return source if isinstance(source, str) else None


def _cut(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    head = limit * 3 // 4
    tail = limit - head
    return text[:head] + CUT_MARK.format(n=len(text) - limit) + text[-tail:]


class Recorder:
    """A run's sample recording: :class:`Capture` (which records, how) writing through a
    :class:`~forgerl.samples.writer.SampleWriter`. Runs in the loop's process and thread,
    at most ``per_step`` records a step (64 of 1,300 tokens: about 50 ms on a busy CPU,
    beside steps of seconds)."""

    def __init__(self, capture: Capture, writer: Any):
        self.capture = capture
        self.writer = writer
        #: Records made since :meth:`take` (for the ``forge_step_samples`` hook).
        self.recorded: list[SampleRecord] = []
        self._failed = False

    @classmethod
    def for_run(
        cls, options: Any, *, run_dir: Any, tokenizer: Any, seed: int = 0, primary_reward: str | None = None,
        secrets: Sequence[str] = (), sources: Sequence[Callable[[], Any]] = (),
    ) -> Recorder | None:
        """From the ``logging.samples`` options; None when they turn recording off."""
        from forgerl.samples.writer import SampleWriter

        if not options.enabled:
            return None

        def decode(ids: Sequence[int]) -> str:
            if not hasattr(tokenizer, "decode"):  # a test's stand-in: the ids themselves
                return " ".join(map(str, ids))
            return str(tokenizer.decode(list(ids), skip_special_tokens=False))

        capture = Capture(
            decode=decode,
            redactor=Redactor(secrets, [partial(run_keys, run_dir), *sources]),
            share=options.share,
            per_step=options.per_step,
            max_chars=options.max_chars,
            seed=seed,
            primary_reward=primary_reward,
        )
        writer = SampleWriter.for_run(run_dir, max_file_bytes=options.max_file_bytes, keep_files=options.keep_files)
        return cls(capture, writer)

    def train(self, episodes: Sequence[Episode], *, step: int, trained: set[int]) -> int:
        return self._write(lambda: self.capture.train(episodes, step=step, trained=trained))

    def evaluation(self, **kwargs: Any) -> int:
        return self._write(lambda: self.capture.evaluation(**kwargs))

    def resume(self, step: int | None) -> None:
        """A run resuming from its checkpoint of ``step`` (None: starting again from step 0
        over an earlier attempt's records): drop the records it will make again."""
        try:
            dropped = self.writer.drop_after(step)
        except OSError as exc:
            log.warning("samples of the steps after %s may be recorded twice: %s", step, exc)
            return
        if dropped:
            log.info("samples: %d records of the steps made again dropped (resuming at step %d)", dropped, step or 0)

    def take(self) -> list[SampleRecord]:
        """The records made since the last call."""
        taken, self.recorded = self.recorded, []
        return taken

    def _write(self, make: Callable[[], list[SampleRecord]]) -> int:
        try:
            records = make()
        except Exception as exc:  # samples are for looking at: never the run's failure
            if not self._failed:
                log.warning("samples are not recorded: %s: %s", type(exc).__name__, exc, exc_info=True)
                self._failed = True
            return 0
        self.recorded.extend(records)
        return int(self.writer.write(records))
