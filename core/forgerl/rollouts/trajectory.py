"""One multi-turn trajectory: the environment's turns and the generator's, as tokens.

A trajectory is one training sample: the first prompt (the template's rendering of the
environment's first messages), then a "completion" holding every later token: each
sampled turn with its sampling logprobs and the policy version that sampled it (mask 1),
interleaved with the environment's observation tokens (mask 0: never in the loss, logprob
0). The generator is asked for each turn with the whole sequence so far as token ids, so
the tokens trained on are the tokens sampled, in the context they were sampled in.

Environment calls run on worker threads under ``turn_timeout`` (:mod:`forgerl.rollouts.bounded`);
generation requests of concurrent trajectories are gathered into batches
(:class:`RequestBatcher`), so the generator works on every turn that is ready while
environments think.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from forgerl.environment import Environment, Step
from forgerl.errors import ImageError
from forgerl.images import ImageLimits, has_images
from forgerl.images.parts import part_reference
from forgerl.interfaces import Generator
from forgerl.rollouts.bounded import CallTimeout, call_bounded
from forgerl.rollouts.chat_tokens import ChatTokens
from forgerl.types import (
    Completion,
    GenerationRequest,
    ImageInputs,
    Problem,
    SamplingParams,
    reserved_component_error,
)

log = logging.getLogger("forgerl.environment")

FailureKind = Literal["timeout", "error", "garbage"]
_ROLES = frozenset({"system", "user", "assistant", "tool"})
#: Characters of one environment message: more is garbage (a runaway observation).
MAX_MESSAGE_CHARS = 100_000


@dataclass(frozen=True)
class Limits:
    """``environment``'s bounds: assistant turns, tokens after the first prompt (sampled
    and environment tokens together), tokens per assistant turn, seconds per environment
    call, trajectories in flight."""

    max_turns: int = 4
    max_total_tokens: int = 512
    max_turn_tokens: int = 64
    turn_timeout: float = 10.0
    concurrency: int = 16


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion: Completion
    #: The environment's reward; None when it leaves scoring to the Reward plugins.
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    #: Why the environment failed this trajectory (None: it did not).
    failure: str | None = None
    failure_kind: FailureKind | None = None
    #: The limit that ended it ("turns", "total_tokens"), or None.
    limit: str | None = None
    turns: int = 0
    observations: int = 0
    #: The last assistant turn's text (what the Reward plugins score).
    last_text: str = ""
    #: An agent's episode (forgerl.rollouts.agent_episode): segments before the trained one (its
    #: history rewrites), and the sampled tokens in them (not trained on).
    rewrites: int = 0
    dropped_tokens: int = 0
    #: The conversation as chat messages (reset's, then each turn and observation), for sample records.
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Every image the environment showed so far, as the generator and trainer get them
    #: (None: none); and the sequence's ids with one placeholder per image (for vLLM).
    images: ImageInputs | None = None
    unexpanded_ids: list[int] = field(default_factory=list)


class GarbageError(Exception):
    """An environment returned something that is not what its interface says."""


class _GeneratorFailed(Exception):
    """Carries the generator's exception past the handlers that contain environment
    failures: a generator that fails is the run's problem, as in single-turn rollouts."""


class RequestBatcher:
    """Gathers the single-turn requests of concurrent trajectories into generator batches:
    while one batch is generated, new requests wait and go together in the next. Lives on
    one event loop (make one per loop)."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self._pending: list[tuple[GenerationRequest, asyncio.Future[Completion]]] = []
        self._task: asyncio.Task[None] | None = None
        #: Batches sent, and requests in them (mean batch size = requests / batches).
        self.batches = 0
        self.requests = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            self.batches += 1
            self.requests += len(batch)
            try:
                results = await self.generator.generate([r for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - each waiting trajectory re-raises it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), completions in zip(batch, results):
                if not future.done():
                    future.set_result(completions[0])


def check_messages(value: Any, what: str) -> list[dict[str, Any]]:
    """``value`` as chat messages, or GarbageError saying what is wrong."""
    if not isinstance(value, (list, tuple)):
        raise GarbageError(f"{what} returned {type(value).__name__}, not a list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise GarbageError(f"{what}: message {i} is {type(m).__name__}, not a dict")
        content = m.get("content")
        if m.get("role") not in _ROLES or not isinstance(content, (str, list)):
            raise GarbageError(
                f"{what}: message {i} needs a role in {sorted(_ROLES)} and a string content (or content parts)"
            )
        if isinstance(content, list):
            # Content parts (images, docs/vision.md): each checked for its shape here, the
            # images themselves when they are loaded.
            try:
                text = "".join(p["text"] for p in content if part_reference(p) is None)
            except ImageError as exc:
                raise GarbageError(f"{what}: message {i}: {exc}") from None
        else:
            text = content
        if len(text) > MAX_MESSAGE_CHARS:
            raise GarbageError(f"{what}: message {i} has {len(text)} characters (at most {MAX_MESSAGE_CHARS})")
        out.append(dict(m))
    return out


def check_step(value: Any) -> Step:
    if not isinstance(value, Step):
        raise GarbageError(f"step returned {type(value).__name__}, not a Step")
    check_messages(list(value.messages), "step")
    if not value.done and not value.messages:
        raise GarbageError("step returned neither observation messages nor done")
    if value.reward is not None and (not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward)):
        raise GarbageError(f"step's reward {value.reward!r} is not a finite number")
    for key, v in dict(value.components).items():
        if not isinstance(key, str) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GarbageError(f"step's component {key!r}: {v!r} is not a finite number")
        if (reserved := reserved_component_error(key)) is not None:
            raise GarbageError(f"step's component {key!r}: {reserved}; rename the component")
    return value


class TrajectoryRunner:
    """Runs trajectories of one environment class against one generator."""

    def __init__(
        self,
        make_env: Callable[[], Environment],
        env_class: type[Environment],
        tokenizer: Any,
        limits: Limits,
        sampling: SamplingParams,
        processor: Any = None,
        image_limits: ImageLimits | None = None,
    ):
        from forgerl.environment import tool_schemas

        self.make_env = make_env
        self.scores = bool(env_class.scores)
        self.chat = ChatTokens(tokenizer, tool_schemas(env_class))
        self.limits = limits
        self.sampling = sampling
        #: A VLM's processor: environments may show images (None: an image fails the trajectory).
        self.processor = processor
        self.image_limits = image_limits or ImageLimits()

    async def run_many(
        self, generator: Generator, jobs: Sequence[tuple[Problem, str, int]], sampling: SamplingParams | None = None
    ) -> tuple[list[Trajectory], RequestBatcher]:
        """Trajectories for ``(problem, request id, seed)`` jobs, at most ``concurrency`` at
        a time, in job order."""
        return await run_concurrently(self.run, generator, jobs, self.limits.concurrency, sampling)

    async def run(
        self, batcher: RequestBatcher, problem: Problem, request_id: str, seed: int,
        sampling: SamplingParams | None = None,
    ) -> Trajectory:
        lim = self.limits
        # The served version until a turn is sampled (a trajectory failed at reset has none).
        version = batcher.generator.policy_version
        traj = Trajectory(prompt_ids=[], completion=Completion([], [], "stop", version, mask=[], versions=[]))
        env: Environment | None = None
        try:
            env = await call_bounded(self.make_env, timeout=lim.turn_timeout, what="environment init")
            messages = check_messages(
                await call_bounded(env.reset, problem, timeout=lim.turn_timeout, what="reset"), "reset"
            )
            if not messages:
                raise GarbageError("reset returned no messages")
            if has_images(messages):
                self._first_images(traj, messages)
            else:
                traj.prompt_ids = self.chat.prompt_ids(messages)
                traj.unexpanded_ids = list(traj.prompt_ids)
            traj.messages = list(messages)
            await self._turns(batcher, env, traj, request_id, seed, sampling or self.sampling)
        except _GeneratorFailed as exc:
            assert exc.__cause__ is not None, "raised from the generator's exception"
            raise exc.__cause__ from None
        except CallTimeout as exc:
            self._fail(traj, "timeout", str(exc))
        except (GarbageError, ImageError) as exc:
            self._fail(traj, "garbage", str(exc))
        except Exception as exc:  # noqa: BLE001 - the environment's failure is its trajectory's, not the run's
            self._fail(traj, "error", f"{type(exc).__name__}: {exc}")
        finally:
            if env is not None:
                try:
                    await call_bounded(env.close, timeout=lim.turn_timeout, what="close")
                except Exception as exc:  # noqa: BLE001 - closing is best effort
                    log.warning("environment close failed: %s", exc)
        if not traj.prompt_ids:
            # Reset failed: a minimal prompt keeps the sample well-formed (nothing is trained).
            traj.prompt_ids = self.chat.ids(str(problem.prompt)[:200] or " ") or [0]
        return traj

    async def _turns(
        self, batcher: RequestBatcher, env: Environment, traj: Trajectory, request_id: str, seed: int,
        sampling: SamplingParams,
    ) -> None:
        lim = self.limits
        c = traj.completion
        assert c.mask is not None and c.versions is not None, "a trajectory's completion carries its mask"
        versions: list[int] = []
        for turn in range(lim.max_turns):
            room = lim.max_total_tokens - len(c.token_ids)
            request = GenerationRequest(
                request_id=f"{request_id}-t{turn}",
                prompt_token_ids=traj.prompt_ids + c.token_ids,
                n=1,
                sampling=replace(sampling, max_tokens=min(lim.max_turn_tokens, room),
                                 seed=(seed + 7919 * turn) % (2**31 - 1)),
                images=traj.images,
            )
            try:
                sampled = await batcher.generate(request)
            except Exception as exc:
                raise _GeneratorFailed() from exc
            traj.turns += 1
            versions.append(sampled.policy_version)
            c.policy_version = min(versions)  # staleness counts from the oldest sampled token
            c.token_ids += sampled.token_ids
            c.logprobs += sampled.logprobs
            c.mask += [1] * len(sampled.token_ids)
            # A turn that ran across a weight update (update policy keep) has its own.
            c.versions += sampled.versions or [sampled.policy_version] * len(sampled.token_ids)
            c.text += sampled.text
            traj.unexpanded_ids += sampled.token_ids
            traj.last_text = sampled.text
            traj.messages.append({"role": "assistant", "content": sampled.text})
            step = check_step(await call_bounded(env.step, sampled.text, timeout=lim.turn_timeout, what="step"))
            if step.done:
                traj.reward = None if step.reward is None else float(step.reward)
                traj.components = {k: float(v) for k, v in dict(step.components).items()}
                break
            if turn == lim.max_turns - 1:
                # No turn left to read an observation: it would be tokens nobody answers.
                traj.limit = "turns"
                break
            observed = check_messages(list(step.messages), "step")
            images: ImageInputs | None
            if has_images(observed):
                observation, unexpanded, images = self._observed_images(traj, sampled.token_ids, observed)
            else:
                observation = self.chat.observation_ids(sampled.token_ids, observed)
                unexpanded, images = observation, traj.images
            traj.observations += 1
            # An observation must leave room for at least one more sampled token.
            if len(c.token_ids) + len(observation) >= lim.max_total_tokens:
                traj.limit = "total_tokens"
                break
            traj.messages.extend(observed)
            traj.images = images
            traj.unexpanded_ids += unexpanded
            c.token_ids += observation
            c.logprobs += [0.0] * len(observation)
            c.mask += [0] * len(observation)
            c.versions += [sampled.policy_version] * len(observation)
        if traj.limit is not None:
            c.finish_reason = "length"
            if self.scores:
                traj.reward, traj.components = 0.0, {"limit": 1.0}

    # ------------------------------------------------------------------ images

    def _processor(self) -> Any:
        if self.processor is None:
            raise ImageError("the environment showed an image but the model is not a vision-language model")
        return self.processor

    def _first_images(self, traj: Trajectory, messages: list[dict[str, Any]]) -> None:
        from forgerl.images.render import render_chat

        processor = self._processor()
        prompt = self.chat.with_tools_in_system(messages)
        traj.prompt_ids, traj.images = render_chat(processor, prompt, self.image_limits, allow_paths=False)
        assert traj.images is not None, "a chat with image parts renders images"
        traj.unexpanded_ids = list(traj.images.unexpanded_ids)

    def _observed_images(
        self, traj: Trajectory, sampled_ids: Sequence[int], observed: list[dict[str, Any]]
    ) -> tuple[list[int], list[int], ImageInputs]:
        """An observation with images: its expanded and unexpanded ids, and the images of the
        whole trajectory so far with its own (all of them through the image processor again,
        so the features have the layout of one prompt with every image; each image's
        pixels do not depend on the others')."""
        from forgerl.images.loading import load_images
        from forgerl.images.parts import for_template, image_references
        from forgerl.images.render import encode

        processor = self._processor()
        earlier = list(traj.images.images) if traj.images is not None else []
        new = load_images(image_references(observed), self._remaining(len(earlier)), allow_paths=False)
        text = self.chat.turn_close(sampled_ids) + self.chat.observation_text(for_template(observed))
        expanded, _ = encode(processor, text, new)
        unexpanded = self.chat.ids(text)
        everything = [*earlier, *new]
        # Nested: one sample with every image (as the processor passes a prompt's images).
        features = processor.image_processor([everything], return_tensors="pt")
        images = ImageInputs(
            images=tuple(everything),
            features=dict(features),
            unexpanded_ids=tuple(traj.unexpanded_ids + unexpanded),
        )
        return expanded, unexpanded, images

    def _remaining(self, shown: int) -> ImageLimits:
        """The image limits of one trajectory, less what it has shown (count only: each
        image's own limits stay)."""
        lim = self.image_limits
        if shown >= lim.max_images:
            raise ImageError(f"the environment showed over {lim.max_images} images in one trajectory")
        return replace(lim, max_images=lim.max_images - shown)

    @staticmethod
    def _fail(traj: Trajectory, kind: FailureKind, reason: str) -> None:
        fail_trajectory(traj, kind, reason)

    def extra_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Metrics of this kind of rollout beyond the ``env/*`` every environment gets."""
        return {}

    def close(self) -> None:
        """Nothing to release: environments are closed with their trajectories."""


def fail_trajectory(traj: Trajectory, kind: FailureKind, reason: str) -> None:
    """An environment failure is not the model's: its tokens leave the loss."""
    traj.failure, traj.failure_kind = reason, kind
    c = traj.completion
    c.mask = [0] * len(c.token_ids)
    log.warning("environment failed a trajectory (%s): %s", kind, reason)



async def run_concurrently(
    run: Callable[..., Awaitable[Trajectory]],
    generator: Generator,
    jobs: Sequence[tuple[Problem, str, int]],
    concurrency: int,
    sampling: SamplingParams | None,
) -> tuple[list[Trajectory], RequestBatcher]:
    """``run(batcher, problem, request_id, seed, sampling=)`` for each job, at most
    ``concurrency`` at a time, their generations batched together; results in job order."""
    batcher = RequestBatcher(generator)
    gate = asyncio.Semaphore(concurrency)

    async def one(job: tuple[Problem, str, int]) -> Trajectory:
        async with gate:
            return await run(batcher, *job, sampling=sampling)

    return list(await asyncio.gather(*(one(j) for j in jobs))), batcher

