"""Rollout production: prompts → completions → rewards, in a thread beside training.

This is ``loop.overlap: versioned`` (the default; ``continuous`` is :mod:`forgerl.rollouts.overlap`).
Batch ``k`` (the batch trained on at step ``k``) is generated with policy version
``max(0, k - max_staleness)`` exactly: the producer waits for that version, and the loop
holds back the weight update to version ``v + 1`` until every batch that should use
version ``v`` is done. So generation of the next ``max_staleness`` batches overlaps
training, and a run is reproducible (and resumable) step for step whatever the timing.
Samples with tokens of an older version than that (a failed weight update, an
asynchronous engine, a completion that ran across an update under ``keep``) are dropped by
the loop, or their too-old tokens left out of the loss (``loop.stale_samples``), and
counted (:mod:`forgerl.rollouts.staleness`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forgerl.errors import ImageError, NotSupported
from forgerl.images import ImageLimits, has_images
from forgerl.images.render import render_chat
from forgerl.interfaces import Generator
from forgerl.rollouts.chat_tokens import text_prompt_ids
from forgerl.types import Episode, GenerationRequest, ImageInputs, Problem, RewardInput, SamplingParams

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.rollouts.env_rollouts import EnvironmentRollouts
    from forgerl.rollouts.problem_source import ProblemSource


@dataclass
class RolloutBatch:
    index: int
    episodes: list[Episode]
    policy_version: int
    task_state: dict[str, Any]
    gen_seconds: float = 0.0
    reward_seconds: float = 0.0
    gen_tokens: int = 0
    rewards_failed: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def sampling_seed(seed: int, index: int, group: int) -> int:
    """A per-(batch, prompt) seed: sampling depends on the run seed and the position only."""
    return (seed * 1_000_003 + index * 10_007 + group * 101) % (2**31 - 1)


class Tokenizing:
    """Prompt → token ids with the model's chat template (for chat prompts); with a
    vision-language model's ``processor``, a prompt with images → ids and its images
    (:mod:`forgerl.images.render`)."""

    def __init__(
        self,
        tokenizer: Any,
        processor: Any = None,
        limits: ImageLimits | None = None,
        *,
        images_refused: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.processor = processor
        self.limits = limits or ImageLimits()
        #: Why prompts with images cannot run (a generator without ``accepts_images``).
        self.images_refused = images_refused

    def render(self, problem: Problem) -> tuple[list[int], ImageInputs | None]:
        """The prompt's ids and images (None: no images). :class:`ImageError` for a bad
        image; NotSupported for images and a model without a processor."""
        if not has_images(problem.prompt):
            return self.prompt_ids(problem), None
        if self.images_refused is not None:
            raise NotSupported(self.images_refused)
        if self.processor is None:
            raise NotSupported(
                f"problem {problem.id!r} has images but the model is not a vision-language model (docs/vision.md)"
            )
        return render_chat(self.processor, list(problem.prompt), self.limits)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """A text prompt's ids; NotSupported for one with images, which only the paths
        that carry images (:meth:`render`) take: ids without their pixels would be a
        silently different prompt."""
        if has_images(problem.prompt):
            raise NotSupported(
                f"problem {problem.id!r} has images, which this part of the loop does not carry yet "
                "(images work in single-turn runs with loop.overlap: versioned; docs/vision.md)"
            )
        tok = self.tokenizer
        if isinstance(problem.prompt, str):
            return text_prompt_ids(tok, problem.prompt)
        text = tok.apply_chat_template(list(problem.prompt), add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])


class RolloutBuffer:
    """Hand-over between the producer thread and the training loop, with the version gate."""

    def __init__(self, max_staleness: int, next_index: int, version: int):
        self.max_staleness = max_staleness
        self.cond = threading.Condition()
        self.ready: dict[int, RolloutBatch] = {}
        self.next_index = next_index  # the next batch the producer will make
        self.version = version  # the generator's current policy version
        self.error: BaseException | None = None
        self.stopped = False

    def required_version(self, index: int) -> int:
        return max(0, index - self.max_staleness)

    # ---------------------------------------------------------------- producer side

    def wait_turn(self, index: int) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.version >= self.required_version(index))
            return not self.stopped

    def put(self, batch: RolloutBatch) -> None:
        with self.cond:
            self.ready[batch.index] = batch
            self.next_index = batch.index + 1
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify_all()

    # ---------------------------------------------------------------- loop side

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def get(self, index: int, timeout: float | None = None) -> RolloutBatch:
        with self.cond:
            ok = self.cond.wait_for(lambda: index in self.ready or self.error is not None, timeout)
            self._check()
            if not ok:
                raise TimeoutError(f"no rollouts for step {index} after {timeout} s")
            return self.ready.pop(index)

    def wait_done_through(self, index: int) -> None:
        """Block until every batch up to ``index`` has been produced."""
        with self.cond:
            self.cond.wait_for(lambda: self.next_index > index or self.error is not None)
            self._check()

    def set_version(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def pending(self) -> list[RolloutBatch]:
        with self.cond:
            return [self.ready[i] for i in sorted(self.ready)]

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class RolloutProducer(threading.Thread):
    """Makes batches ``start, start+1, ...`` until stopped (or ``last`` is made)."""

    def __init__(
        self,
        *,
        buffer: RolloutBuffer,
        generator: Generator,
        source: ProblemSource,
        score: Callable[[list[RewardInput]], Any],
        tokenizing: Tokenizing,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        start: int,
        last: int,
        environment: EnvironmentRollouts | None = None,
    ):
        super().__init__(daemon=True, name="forge-rollouts")
        self.buffer = buffer
        self.generator = generator
        self.source = source  # the task, after any problems a checkpoint requeued
        self.score = score
        self.tokenizing = tokenizing
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.sampling = sampling
        self.seed = seed
        self.start_index = start
        self.last = last
        #: Multi-turn trajectories instead of single completions (None: single-turn).
        self.environment = environment

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            for index in range(self.start_index, self.last + 1):
                if not self.buffer.wait_turn(index):
                    return
                self.buffer.put(loop.run_until_complete(self.make_batch(index)))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which re-raises
            self.buffer.fail(exc)
        finally:
            loop.close()

    async def make_batch(self, index: int) -> RolloutBatch:
        problems = self.source.next_problems(self.prompts_per_step)
        task_state = self.source.state_dict()
        version = self.generator.policy_version
        env = self.environment
        # Group g keeps its position, request ids and seeds whichever way it runs: a mixture
        # whose environment takes some sources only (environment.sources) samples the
        # others single-turn, both halves at once.
        through_env = [g for g, p in enumerate(problems) if env is not None and env.takes(p)]
        single = sorted(set(range(len(problems))) - set(through_env))
        t0 = time.perf_counter()
        parts = await asyncio.gather(
            *([self._trajectory_part(index, problems, through_env)] if through_env else []),
            *([self._single_turn_part(index, problems, single)] if single else []),
        )
        episodes = sorted((e for part in parts for e in part.episodes), key=lambda e: e.group_id)
        batch = RolloutBatch(
            index=index,
            episodes=episodes,
            policy_version=version,
            task_state=task_state,
            gen_tokens=sum(part.gen_tokens for part in parts),
            rewards_failed=sum(part.rewards_failed for part in parts),
            extra={k: v for part in parts for k, v in part.extra.items()},
        )
        if len(parts) == 1:
            batch.gen_seconds, batch.reward_seconds = parts[0].gen_seconds, parts[0].reward_seconds
        else:  # the halves overlap: one figure, as for trajectories
            batch.gen_seconds = time.perf_counter() - t0
        return batch

    async def _single_turn_part(self, index: int, problems: list[Problem], groups: list[int]) -> RolloutBatch:
        """Completions of the ``groups`` (positions in ``problems``), scored. A group whose
        prompt has a bad image is left out; the others keep their numbers and seeds."""
        rendered = self._render(problems, groups)
        groups = [g for g in groups if g in rendered]
        if not groups:  # every prompt's image failed: nothing to sample
            return RolloutBatch(index=index, episodes=[], policy_version=-1, task_state={})
        requests = [
            GenerationRequest(
                request_id=f"b{index}-g{g}",
                prompt_token_ids=rendered[g][0],
                n=self.group_size,
                sampling=_with_seed(self.sampling, sampling_seed(self.seed, index, g)),
                images=rendered[g][1],
            )
            for g in groups
        ]
        t0 = time.perf_counter()
        results = await self.generator.generate(requests)
        t1 = time.perf_counter()
        inputs = [
            RewardInput(problem=problems[g], completion_text=c.text, finish_reason=c.finish_reason)
            for g, comps in zip(groups, results)
            for c in comps
        ]
        scores = await self.score(inputs)
        t2 = time.perf_counter()
        episodes = []
        k = 0
        for g, comps in zip(groups, results):
            ids, images = rendered[g]
            for c in comps:
                s = scores[k]
                k += 1
                episodes.append(
                    Episode(
                        problem=problems[g],
                        group_id=g,
                        prompt_token_ids=ids,
                        completion=c,
                        reward=float(s.value),
                        reward_components=dict(s.components),
                        reward_failed=bool(s.failed),
                        error=s.error if s.failed else None,
                        images=images,
                    )
                )
        return RolloutBatch(
            index=index,
            episodes=episodes,
            policy_version=-1,  # the caller's
            task_state={},
            gen_seconds=t1 - t0,
            reward_seconds=t2 - t1,
            gen_tokens=sum(len(e.completion.token_ids) for e in episodes),
            rewards_failed=sum(e.reward_failed for e in episodes),
        )

    def _render(self, problems: list[Problem], groups: list[int]) -> dict[int, tuple[list[int], ImageInputs | None]]:
        """Each group's prompt ids and images. A problem with a bad image fails alone,
        with one line in the log: the run goes on with the others (docs/vision.md)."""
        rendered = {}
        for g in groups:
            try:
                rendered[g] = self.tokenizing.render(problems[g])
            except ImageError as exc:
                log.warning("problem %r skipped: %s", problems[g].id, exc)
        return rendered

    async def _trajectory_part(self, index: int, problems: list[Problem], groups: list[int]) -> RolloutBatch:
        """Trajectories of the ``groups`` through the environment, scored."""
        assert self.environment is not None, "trajectory batches need an environment"
        episodes, extra, seconds = await self.environment.batch(
            self.generator,
            [problems[g] for g in groups],
            index=index,
            seeds=[sampling_seed(self.seed, index, g) for g in groups],
            group_size=self.group_size,
            score=self.score,
            groups=groups,
        )
        return RolloutBatch(
            index=index,
            episodes=episodes,
            policy_version=-1,  # the caller's
            task_state={},
            gen_seconds=seconds,  # generation, environments and scoring overlap: one figure
            gen_tokens=sum(sum(e.completion.mask or ()) for e in episodes),
            rewards_failed=sum(e.reward_failed for e in episodes),
            extra=extra,
        )


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
