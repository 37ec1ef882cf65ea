"""``loop.overlap: continuous``: the generators are kept full and never wait for the trainer.

The synchronous-versioned mode (:mod:`forgerl.rollouts.rollout`) generates batch ``k`` with version
``k - S`` exactly and holds the weight update back until those batches are done: nothing
is generated while weights move, and a long completion holds back its whole batch. Here
instead, with ``S = loop.max_staleness >= 1`` and a generator that updates with requests
in flight (the vllm generator's ``update_policy: keep``):

- the loop updates the generator as soon as a step is trained (the generator pauses in
  place, loads and resumes; requests in flight go on with the new weights, their tokens
  labelled with the version that sampled them);
- the producer admits prompt groups one at a time as earlier ones finish, each as its own
  request, while fewer than ``loop.max_in_flight`` are generating (a group being scored
  no longer loads the generator, and does not count), and
  group ``j`` (0-based, counted over the run) only once the generator serves version
  ``j // P - S`` or newer (``P = loop.prompts_per_step``): what the versioned mode
  generates batch ``j // P`` with. So the producer runs at most ``S`` versions ahead, and
  groups wait in the buffer, not in the generator, when the trainer is slow;
- each group is scored as soon as it finishes, and a batch is the first ``P`` groups to
  finish, in completion order: a short completion never waits for a long one. A group that
  finishes late may land in a batch trained more than ``S`` versions after its oldest
  token; the loop then drops it or masks its too-old tokens (``loop.stale_samples``).

Timing decides which groups form which batch, so a run is not reproducible step for step
(the sampling seed of each group still depends only on its position ``j``). Checkpoints
hold the finished batches; problems drawn but not yet in one go back to the task
(:mod:`forgerl.rollouts.problem_source`) and are drawn first after a resume, so a resume neither
skips nor repeats a prompt, though it samples those groups again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from forgerl.errors import ImageError
from forgerl.interfaces import Generator
from forgerl.rollouts.problem_source import ProblemSource, with_requeued
from forgerl.rollouts.rollout import RolloutBatch, Tokenizing, sampling_seed
from forgerl.rollouts.staleness import oldest_version
from forgerl.types import (
    Completion,
    Episode,
    GenerationRequest,
    ImageInputs,
    Problem,
    RewardInput,
    SamplingParams,
)

log = logging.getLogger(__name__)

Score = Callable[[list[RewardInput]], Awaitable[Any]]


def default_in_flight(prompts_per_step: int, max_staleness: int) -> int:
    """Groups in flight by default: what the staleness bound lets the producer admit
    (batches up to ``S`` ahead of the one being trained, and that one)."""
    return (1 + max_staleness) * prompts_per_step


@dataclass
class FinishedGroup:
    """One prompt's ``group_size`` completions, scored."""

    number: int  # j: admission order over the run
    problem: Problem
    prompt_ids: list[int]
    completions: list[Completion]
    scores: list[Any]
    reward_seconds: float
    #: The prompt's images (None: a text prompt).
    images: ImageInputs | None = None


class ContinuousBuffer:
    """Hand-over between the continuous producer and the loop: the admission gate (in-flight
    cap, staleness bound), finished groups forming batches in completion order, and what a
    checkpoint saves. Same loop-side methods as :class:`forgerl.rollouts.rollout.RolloutBuffer`."""

    def __init__(
        self,
        *,
        prompts_per_step: int,
        max_staleness: int,
        max_in_flight: int,
        next_index: int,
        version: int,
        task_state: dict[str, Any],
        requeued: list[Problem],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.max_in_flight = max_in_flight
        self.cond = threading.Condition()
        self.ready: dict[int, RolloutBatch] = {}
        self.next_index = next_index  # the next batch to form
        self.next_group = next_index * prompts_per_step  # j of the next group to admit
        self.version = version
        self.in_flight = 0  # admitted, generation not done yet
        #: Why the producer waits, while it does: "room" (the in-flight cap), "version"
        #: (the staleness bound); None while it admits or has stopped.
        self.waiting_for: str | None = None
        self.error: BaseException | None = None
        self.stopped = False
        self.clock = clock
        self._finished: list[FinishedGroup] = []
        #: Problems drawn from the source and not yet in a batch, by admission order (j),
        #: and the source's position after the last draw (the task's state, the requeued
        #: problems it has not given out): together what a checkpoint saves.
        self._unbatched: dict[int, Problem] = {}
        self._task_state = task_state
        self._requeued = list(requeued)
        self._batch_started = clock()

    def required_version(self, group: int) -> int:
        return max(0, group // self.prompts_per_step - self.max_staleness)

    # ---------------------------------------------------------------- producer side

    def admit(self, group: int) -> bool:
        """Wait until group ``group`` may be admitted and count it in flight; False when
        the run stops (or failed) first."""
        with self.cond:
            while True:
                if self.stopped or self.error is not None:
                    self.waiting_for = None
                    return False
                if self.in_flight >= self.max_in_flight:
                    why = "room"
                elif self.version < self.required_version(group):
                    why = "version"
                else:
                    break
                if self.waiting_for != why:
                    self.waiting_for = why
                    self.cond.notify_all()  # for whoever watches the producer (tests)
                self.cond.wait()
            self.waiting_for = None
            self.in_flight += 1
            self.next_group = group + 1
            return True

    def drawn(self, first: int, problems: list[Problem], source: ProblemSource) -> None:
        """``problems`` were drawn from ``source`` for groups ``first, first + 1, ...``."""
        task_state = source.task.state_dict()
        with self.cond:
            for k, p in enumerate(problems):
                self._unbatched[first + k] = p
            self._task_state, self._requeued = task_state, list(source.requeued)

    def generated(self) -> None:
        """A group's generation is done (its scoring starts): room for another."""
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def finish(self, group: FinishedGroup) -> None:
        """A group is scored; every ``prompts_per_step`` groups scored form the next batch."""
        with self.cond:
            self._finished.append(group)
            if len(self._finished) >= self.prompts_per_step:
                taken = self._finished[: self.prompts_per_step]
                del self._finished[: self.prompts_per_step]
                for g in taken:
                    self._unbatched.pop(g.number, None)
                self._form(taken)
            self.cond.notify_all()

    def _form(self, groups: list[FinishedGroup]) -> None:
        now = self.clock()
        episodes = [
            Episode(
                problem=g.problem,
                group_id=position,  # unique within the batch, in completion order
                prompt_token_ids=g.prompt_ids,
                completion=c,
                reward=float(s.value),
                reward_components=dict(s.components),
                reward_failed=bool(s.failed),
                error=s.error if s.failed else None,
                images=g.images,
            )
            for position, g in enumerate(groups)
            for c, s in zip(g.completions, g.scores)
        ]
        index = self.next_index
        self.ready[index] = RolloutBatch(
            index=index,
            episodes=episodes,
            policy_version=min((oldest_version(e.completion) for e in episodes), default=self.version),
            task_state=self._saved_task_state(),
            # Generation and scoring overlap across groups: the time this batch took to
            # fill, scoring included, is its one generation figure.
            gen_seconds=now - self._batch_started,
            reward_seconds=sum(g.reward_seconds for g in groups),
            gen_tokens=sum(len(e.completion.token_ids) for e in episodes),
            rewards_failed=sum(e.reward_failed for e in episodes),
        )
        self._batch_started = now
        self.next_index = index + 1

    def _saved_task_state(self) -> dict[str, Any]:
        """The task's state after the last draw, with every drawn problem not in a batch
        yet to be drawn first after a resume (before the source's own requeued ones)."""
        unbatched = [self._unbatched[j] for j in sorted(self._unbatched)]
        return with_requeued(self._task_state, [*unbatched, *self._requeued])

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    # ---------------------------------------------------------------- loop side

    def get(self, index: int, timeout: float | None = None) -> RolloutBatch:
        with self.cond:
            ok = self.cond.wait_for(lambda: index in self.ready or self.error is not None, timeout)
            if self.error is not None:
                raise self.error
            if not ok:
                raise TimeoutError(f"no rollouts for step {index} after {timeout} s")
            return self.ready.pop(index)

    def set_version(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def saved(self, step: int) -> tuple[list[RolloutBatch], dict[str, Any]]:
        """What a checkpoint at ``step`` holds, taken at one instant: the finished batches
        for later steps, each carrying the task state the checkpoint saves (the task after
        its last draw, every drawn problem not in those batches requeued)."""
        from dataclasses import replace

        with self.cond:
            state = self._saved_task_state()
            pending = [replace(self.ready[i], task_state=state) for i in sorted(self.ready) if i >= step]
            return pending, state

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class ContinuousProducer(threading.Thread):
    """Admits the run's groups ``buffer.next_group ... last_group`` as the buffer allows,
    each one request of ``group_size`` completions, scored as soon as it finishes."""

    def __init__(
        self,
        *,
        buffer: ContinuousBuffer,
        generator: Generator,
        source: ProblemSource,
        score: Score,
        tokenizing: Tokenizing,
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        last_group: int,
    ):
        super().__init__(daemon=True, name="forge-rollouts")
        self.buffer = buffer
        self.generator = generator
        self.source = source
        self.score = score
        self.tokenizing = tokenizing
        self.group_size = group_size
        self.sampling = sampling
        self.seed = seed
        self.last_group = last_group
        self._queue: list[Problem] = []  # drawn, not admitted yet

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._admit_all())
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which re-raises
            self.buffer.fail(exc)
        finally:
            loop.close()

    async def _admit_all(self) -> None:
        groups: set[asyncio.Task[None]] = set()
        try:
            j = self.buffer.next_group
            while j <= self.last_group:
                if not self._queue:
                    self._draw(j)
                # The gate blocks (a threading condition): in a thread, so that the groups
                # in flight on this event loop go on finishing meanwhile.
                if not await asyncio.to_thread(self.buffer.admit, j):
                    return
                task = asyncio.get_running_loop().create_task(self._group(j, self._queue.pop(0)))
                groups.add(task)
                task.add_done_callback(groups.discard)
                j += 1
            while groups:
                await asyncio.gather(*groups)
        finally:
            for task in groups:
                task.cancel()
            if groups:
                await asyncio.gather(*groups, return_exceptions=True)

    def _draw(self, first: int) -> None:
        """The next ``prompts_per_step`` problems, drawn as the versioned mode draws a
        batch's: the task sees the same calls. (Groups are admitted from a multiple of
        ``prompts_per_step`` and the run needs ``steps x prompts_per_step``: every draw is
        used whole.)"""
        problems = self.source.next_problems(self.buffer.prompts_per_step)
        self.buffer.drawn(first, problems, self.source)
        self._queue.extend(problems)

    async def _group(self, j: int, problem: Problem) -> None:
        P = self.buffer.prompts_per_step
        try:
            try:
                ids, images = self.tokenizing.render(problem)
            except ImageError as exc:
                # The problem fails alone (no samples from it); the run goes on (docs/vision.md).
                log.warning("problem %r skipped: %s", problem.id, exc)
                self.buffer.generated()  # its slot in flight is free again
                self.buffer.finish(FinishedGroup(j, problem, [], [], [], 0.0))
                return
            request = GenerationRequest(
                request_id=f"b{j // P}-g{j % P}",
                prompt_token_ids=ids,
                n=self.group_size,
                sampling=_with_seed(self.sampling, sampling_seed(self.seed, j // P, j % P)),
                images=images,
            )
            completions = (await self.generator.generate([request]))[0]
            self.buffer.generated()
            t = time.perf_counter()
            scores = await self.score(
                [RewardInput(problem=problem, completion_text=c.text, finish_reason=c.finish_reason)
                 for c in completions]
            )  # fmt: skip
            reward_seconds = time.perf_counter() - t
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which re-raises
            self.buffer.fail(exc)
            return
        self.buffer.finish(FinishedGroup(j, problem, ids, completions, list(scores), reward_seconds, images))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
