"""One agent episode's calls, captured as tokens: what the agent endpoint trains on.

An agent calls the endpoint with whole conversations (the chat-completions API is
stateless). The episode keeps the conversation as tokens instead, as
:mod:`forgerl.rollouts.trajectory` does for environments:

- the first call: the template's rendering of its messages (tools offered) is the prompt;
  the sampled turn is appended as sampled (mask 1, its logprobs and policy version);
- a call that **extends** the previous one (the same messages and tools, then the
  assistant message the endpoint returned, then new messages): only the new messages'
  tokens are appended (mask 0, :meth:`forgerl.rollouts.chat_tokens.ChatTokens.observation_ids`),
  after the sampled tokens, and the model samples from exactly that sequence. What was
  sampled is never re-tokenised;
- a call that does not (the agent rewrote, cut or summarised its history, changed its
  tools, or edited what the model said) starts a new **segment**: its messages rendered
  as a new prompt. Segments before the last are not trained on (their tokens were sampled
  in another context than the final answer's), and are counted
  (``env/agent_rewrites_mean``, ``env/agent_dropped_tokens_mean``).

The episode's trajectory is its last segment. Calls are served one at a time (a second
concurrent call waits for the first). Limits (``environment.max_turns`` calls,
``max_total_tokens`` per segment, ``max_turn_tokens`` per call, the prompt bound, the
model's context) answer with an OpenAI-style 400 and mark the trajectory as cut by a limit.

Everything here runs on the endpoint's event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from forgerl.errors import ImageError
from forgerl.images import ImageLimits, has_images
from forgerl.rollouts.agent_chat import (
    ApiError,
    ChatCall,
    assistant_message,
    completion_body,
    for_template,
    message_key,
    normal_message,
    tools_key,
)
from forgerl.rollouts.chat_tokens import ChatTokens
from forgerl.rollouts.trajectory import Limits, Trajectory
from forgerl.types import Completion, GenerationRequest, ImageInputs, SamplingParams

Generate = Callable[[GenerationRequest], Awaitable[Completion]]


class GeneratorFailed(Exception):
    """The generator failed a call: the run's problem, not the agent's (``__cause__``)."""


@dataclass
class Segment:
    """A run of calls each extending the one before: one prompt, one completion."""

    prompt_ids: list[int]
    completion: Completion
    #: :func:`message_key` of every message so far, the endpoint's replies included.
    keys: list[str]
    tools: str
    chat: ChatTokens
    last_sampled: list[int] = field(default_factory=list)
    last_text: str = ""
    turns: int = 0
    observations: int = 0
    turn_versions: list[int] = field(default_factory=list)
    #: The conversation as the endpoint saw it: the last call's messages (normal form),
    #: then the assistant message it answered with (for sample records).
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Every image shown in the segment, and its sequence with one placeholder per image.
    images: ImageInputs | None = None
    unexpanded: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """What one call samples from: ``prompt``, all of it; ``segment`` and ``observation``
    when the call extends that segment (None and empty: a new segment from ``prompt``)."""

    chat: ChatTokens
    keys: list[str]
    prompt: list[int]
    segment: Segment | None = None
    observation: list[int] = field(default_factory=list)
    images: ImageInputs | None = None
    #: ``prompt`` (a new segment) or ``observation`` with one placeholder per image.
    unexpanded: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeBounds:
    limits: Limits
    #: Tokens of a segment's first prompt.
    max_prompt_tokens: int
    #: The model's context (prompt and completion), where known.
    context_length: int | None = None


class EpisodeRecorder:
    """Serves one episode's calls and records them (:meth:`call`, then :meth:`trajectory`
    once the episode is closed)."""

    def __init__(
        self, *, chat_for: Callable[[list[dict[str, Any]]], ChatTokens], generate: Generate,
        bounds: EpisodeBounds, sampling: SamplingParams, request_id: str, seed: int, policy_version: int,
        model: str, processor: Any = None, image_limits: ImageLimits | None = None,
    ):
        #: A VLM's processor: calls may show images (data URLs only; None: refused with a 400).
        self.processor = processor
        self.image_limits = image_limits or ImageLimits()
        self.chat_for = chat_for
        self.generate = generate
        self.bounds = bounds
        self.sampling = sampling
        self.request_id = request_id
        self.seed = seed
        self.policy_version = policy_version
        self.model = model
        self.segments: list[Segment] = []
        self.calls = 0
        #: The limit a call ran into ("turns", "total_tokens", "prompt_tokens"), or None.
        self.limit: str | None = None
        self.closed = False
        #: Requests of this episode answered with an error, and the last error's message.
        self.refused = 0
        self.last_refusal = ""
        #: Called (on the endpoint's loop) when the generator fails a call.
        self.on_generator_error: Callable[[BaseException], None] = lambda exc: None
        self._lock = asyncio.Lock()

    async def call(self, call: ChatCall) -> dict[str, Any]:
        """The response body for ``call``, or ApiError."""
        async with self._lock:
            return await self._call(call)

    def close(self) -> None:
        """No call is answered or recorded after this (one in flight is discarded)."""
        self.closed = True

    def refuse(self, err: ApiError) -> None:
        """Count a request of this episode answered with ``err`` (for the failure record)."""
        self.refused += 1
        self.last_refusal = f"{err.status} {err.message}"

    def _refuse_limit(self, limit: str, message: str, code: str) -> ApiError:
        self.limit = self.limit or limit
        return ApiError(400, message, code=code)

    async def _call(self, call: ChatCall) -> dict[str, Any]:
        if self.closed:
            raise ApiError(410, "this episode is over: its agent ended or ran out of time", code="episode_over")
        lim = self.bounds.limits
        if self.calls >= lim.max_turns:
            raise self._refuse_limit("turns", f"this episode has made its {lim.max_turns} calls "
                                     "(environment.max_turns): end the episode", "episode_call_limit")
        plan = self._plan(call)
        request = GenerationRequest(
            request_id=f"{self.request_id}-c{self.calls}",
            prompt_token_ids=plan.prompt,
            n=1,
            sampling=replace(self.sampling, max_tokens=self._room(call, plan), stop=call.stop,
                             seed=(self.seed + 7919 * self.calls) % (2**31 - 1)),
            images=plan.images,
        )
        self.calls += 1
        try:
            sampled = await self.generate(request)
        except Exception as exc:
            self.on_generator_error(exc)
            raise ApiError(500, "the run's generator failed; the run stops", code="generator_error") from exc
        if self.closed:
            raise ApiError(410, "this episode is over: its agent ended or ran out of time", code="episode_over")
        message = assistant_message(sampled.text, tools_offered=bool(call.tools), call_prefix=f"call_{self.calls}",
                                    strict=call.strict)
        self._record(call, plan, sampled, message)
        return completion_body(
            response_id=f"chatcmpl-{self.request_id}-{self.calls}", model=self.model, message=message,
            finish_reason="length" if sampled.finish_reason == "length" else "stop",
            prompt_tokens=len(plan.prompt), completion_tokens=len(sampled.token_ids),
        )

    def _plan(self, call: ChatCall) -> _Plan:
        """What ``call`` is sampled from: the segment's tokens and the new messages' when it
        extends the last segment, else its messages rendered whole (a new segment)."""
        if has_images(call.messages):
            if self.processor is None:
                raise ApiError(400, "this model takes no images (it is not a vision-language model)",
                               param="messages")  # fmt: skip
            try:
                return self._image_plan(call)
            except (ImageError, ValueError) as exc:
                raise ApiError(400, " ".join(str(exc).split()), param="messages") from None
        try:
            chat = self.chat_for(call.tools)
            in_template = chat.tools_via == "template"
            keys = [message_key(m) for m in call.messages]
            segment = self._extended(call, keys)
            if segment is not None:
                new = for_template(call.messages[len(segment.keys):], tools_in_template=in_template)
                try:
                    observation = chat.observation_ids(segment.last_sampled, new)
                    prompt = segment.prompt_ids + segment.completion.token_ids + observation
                    return _Plan(chat, keys, prompt, segment, observation)
                except ValueError:  # the template renders earlier turns anew: render it all
                    pass
            prompt = chat.prompt_ids(for_template(call.messages, tools_in_template=in_template))
        except Exception as exc:  # noqa: BLE001 - a template refusing these messages (jinja raise_exception)
            raise ApiError(400, f"the model's chat template cannot render these messages: "
                           f"{type(exc).__name__}: {str(exc)[:300]}", param="messages") from None
        if len(prompt) > self.bounds.max_prompt_tokens:
            raise self._refuse_limit("prompt_tokens", f"the messages are {len(prompt)} tokens; this endpoint "
                                     f"takes at most {self.bounds.max_prompt_tokens}", "context_length_exceeded")
        return _Plan(chat, keys, prompt, unexpanded=list(prompt))

    def _image_plan(self, call: ChatCall) -> _Plan:
        """:meth:`_plan` for messages with images: the template's text, its placeholders
        expanded by the processor, and every image of the segment (as trajectories do,
        :mod:`forgerl.rollouts.trajectory`)."""
        from forgerl.images.loading import load_images
        from forgerl.images.parts import for_template as image_parts_for_template
        from forgerl.images.parts import image_references
        from forgerl.images.render import encode

        chat = self.chat_for(call.tools)
        in_template = chat.tools_via == "template"
        keys = [message_key(m) for m in call.messages]
        segment = self._extended(call, keys)
        earlier: list[Any] = []
        if segment is not None:
            new_messages = call.messages[len(segment.keys):]
            earlier = list(segment.images.images) if segment.images is not None else []
            text = chat.turn_close(segment.last_sampled) + chat.observation_text(
                image_parts_for_template(for_template(new_messages, tools_in_template=in_template)))
        else:
            new_messages = call.messages
            text = chat.prompt_text(image_parts_for_template(for_template(call.messages, tools_in_template=in_template)))
        limits = self.image_limits
        if len(earlier) >= limits.max_images:
            raise ImageError(f"this episode has shown {len(earlier)} images, the limit is {limits.max_images}")
        new = load_images(image_references(new_messages), replace(limits, max_images=limits.max_images - len(earlier)),
                          allow_paths=False)  # fmt: skip
        expanded, _ = encode(self.processor, text, new)
        unexpanded = chat.ids(text)
        everything = [*earlier, *new]
        base = segment.unexpanded if segment is not None else []
        if everything:
            features = self.processor.image_processor([everything], return_tensors="pt")
            images: ImageInputs | None = ImageInputs(
                images=tuple(everything), features=dict(features), unexpanded_ids=tuple(base + unexpanded))
        else:
            images = None
        if segment is not None:
            prompt = segment.prompt_ids + segment.completion.token_ids + expanded
            return _Plan(chat, keys, prompt, segment, expanded, images, unexpanded)
        if len(expanded) > self.bounds.max_prompt_tokens:
            raise self._refuse_limit("prompt_tokens", f"the messages are {len(expanded)} tokens; this endpoint "
                                     f"takes at most {self.bounds.max_prompt_tokens}", "context_length_exceeded")
        return _Plan(chat, keys, expanded, images=images, unexpanded=unexpanded)

    def _room(self, call: ChatCall, plan: _Plan) -> int:
        """Tokens the call may sample: the turn bound, the agent's own, what is left of the
        segment's budget and of the model's context."""
        lim = self.bounds.limits
        used = len(plan.prompt) - len(plan.segment.prompt_ids) if plan.segment is not None else 0
        room = min(lim.max_turn_tokens, lim.max_total_tokens - used, call.max_tokens or lim.max_turn_tokens)
        if self.bounds.context_length is not None:
            room = min(room, self.bounds.context_length - len(plan.prompt))
        if room < 1:
            raise self._refuse_limit("total_tokens", f"this episode's conversation has no room left "
                                     f"(environment.max_total_tokens {lim.max_total_tokens}, the model's context "
                                     f"{self.bounds.context_length}): end the episode", "context_length_exceeded")
        return room

    def _record(self, call: ChatCall, plan: _Plan, sampled: Completion, message: dict[str, Any]) -> None:
        segment = plan.segment
        if segment is None:
            c = Completion([], [], "stop", sampled.policy_version, mask=[], versions=[])
            segment = Segment(plan.prompt, c, [], "", plan.chat)
            segment.unexpanded = list(plan.unexpanded)
            self.segments.append(segment)
        else:
            self._append(segment, plan.observation, sampled=False, version=segment.turn_versions[-1])
            segment.unexpanded += plan.unexpanded if plan.images is not None else plan.observation
            segment.observations += 1
        if plan.images is not None:
            segment.images = plan.images
        segment.unexpanded += sampled.token_ids
        self._append(segment, sampled.token_ids, sampled=True, version=sampled.policy_version,
                     logprobs=sampled.logprobs, versions=sampled.versions)
        c = segment.completion
        c.text += sampled.text
        c.finish_reason = sampled.finish_reason
        segment.turns += 1
        segment.turn_versions.append(sampled.policy_version)
        c.policy_version = min(segment.turn_versions)  # staleness counts from the oldest sampled token
        segment.last_sampled, segment.last_text = list(sampled.token_ids), sampled.text
        segment.keys = [*plan.keys, message_key(normal_message(message))]
        segment.messages = [*call.messages, message]
        segment.tools = tools_key(call.tools)

    def _extended(self, call: ChatCall, keys: list[str]) -> Segment | None:
        """The segment ``call`` extends: same tools, its messages so far as a prefix, then
        at least one new message."""
        if not self.segments:
            return None
        segment = self.segments[-1]
        n = len(segment.keys)
        if tools_key(call.tools) != segment.tools or len(keys) <= n or keys[:n] != segment.keys:
            return None
        return segment

    @staticmethod
    def _append(segment: Segment, ids: list[int], *, sampled: bool, version: int,
                logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        """``versions``: per token, where the turn ran across a weight update (policy keep)."""
        c = segment.completion
        assert c.mask is not None and c.versions is not None, "a segment's completion carries its mask"
        c.token_ids += ids
        c.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        c.mask += [int(sampled)] * len(ids)
        c.versions += versions or [version] * len(ids)

    # ------------------------------------------------------------------ results

    def trajectory(self) -> Trajectory:
        """The last segment as the episode's trajectory (call after :meth:`close`)."""
        if not self.segments:
            empty = Completion([], [], "stop", self.policy_version, mask=[], versions=[])
            return Trajectory(prompt_ids=[], completion=empty, limit=self.limit)
        s = self.segments[-1]
        c = replace(s.completion, token_ids=list(s.completion.token_ids), logprobs=list(s.completion.logprobs),
                    mask=list(s.completion.mask or []), versions=list(s.completion.versions or []))
        if self.limit is not None:
            c.finish_reason = "length"
        return Trajectory(prompt_ids=list(s.prompt_ids), completion=c, limit=self.limit, turns=s.turns,
                          observations=s.observations, last_text=s.last_text, images=s.images,
                          unexpanded_ids=list(s.unexpanded),
                          messages=json.loads(json.dumps(s.messages)))  # a copy the agent's objects cannot change

    def dropped_tokens(self) -> int:
        """Sampled tokens of the segments before the last (not trained on)."""
        return sum(sum(s.completion.mask or []) for s in self.segments[:-1])
