"""Black-box agents as environments: the agent drives, the run's endpoint captures tokens.

An :class:`AgentEnvironment` is an environment whose turns are not stepped by the run: per
episode the run starts the agent (:meth:`AgentEnvironment.run_episode`) with an
:class:`AgentEpisode` (a base URL of the run's OpenAI-compatible endpoint, the run's key,
the problem); the agent calls the endpoint as it would call any OpenAI-compatible server,
every call is sampled by the run's generator and recorded as tokens
(:mod:`forgerl.rollouts.agent_episode`), and the episode's trajectory is what the agent's calls
sampled. The agent may return the reward; otherwise the run's Reward plugins score the
last assistant turn.

Failures are the agent's trajectory's, as for any environment: an agent that raises
(exits non-zero), runs past ``options.timeout`` (it is cancelled: its process killed, its
thread abandoned), returns something that is not a reward, or never calls the endpoint
fails its trajectory (``loop.failed_reward``, recorded in environment_failures.jsonl).
An agent that stops because the endpoint refused a call over a limit is not a failure:
its trajectory is cut by that limit and scored. A generator that fails is the run's
failure, as in every rollout.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field

from forgerl.configuration.limits import MAX_SECONDS, MAX_TOKENS
from forgerl.environment import Environment, Message, Step
from forgerl.images import ImageLimits
from forgerl.options import OptionsModel
from forgerl.rollouts.agent_chat import tools_key
from forgerl.rollouts.agent_episode import EpisodeBounds, EpisodeRecorder
from forgerl.rollouts.bounded import CallTimeout, call_bounded
from forgerl.rollouts.chat_tokens import ChatTokens
from forgerl.rollouts.trajectory import (
    GarbageError,
    Limits,
    RequestBatcher,
    Trajectory,
    fail_trajectory,
    run_concurrently,
)
from forgerl.types import Problem, SamplingParams, reserved_component_error

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import Generator
    from forgerl.rollouts.agent_endpoint import AgentEndpoint

log = logging.getLogger("forgerl.environment")

#: Named components an agent may return with its reward.
MAX_COMPONENTS = 64
#: Seconds a cancelled agent gets to release what it started (a process to kill).
CANCEL_GRACE = 10.0


@dataclass(frozen=True)
class AgentEpisode:
    """What an agent gets for one episode: point an OpenAI client at ``base_url`` with
    ``api_key`` (``openai.OpenAI(base_url=..., api_key=...)``) and solve ``problem``
    within ``timeout`` seconds. ``model`` is the name the endpoint serves (any name is
    accepted in requests)."""

    base_url: str
    api_key: str
    problem: Problem
    model: str
    timeout: float

    def problem_json(self) -> dict[str, Any]:
        """The problem as JSON-ready data (what a command agent reads on stdin)."""
        p = self.problem
        return {"id": p.id, "prompt": p.prompt, "answer": p.answer, "metadata": dict(p.metadata)}


class AgentEnvironment(Environment):
    """An environment driven by an agent program through the run's endpoint: subclass it
    and implement :meth:`run_episode` (the built-in ``agent`` environment runs a Python
    function or a command). It is not stepped: :meth:`reset` and :meth:`step` are not
    called."""

    scores = False

    class Options(OptionsModel):
        timeout: float = Field(
            120.0, gt=0, le=MAX_SECONDS, description="Seconds an episode may take; then its agent is stopped "
            "(a command killed, a function's thread abandoned) and its trajectory fails."
        )
        max_prompt_tokens: int = Field(
            4096, ge=1, le=MAX_TOKENS, description="Most tokens of a call's messages when they start a conversation "
            "(more: a context_length_exceeded error to the agent)."
        )
        max_request_bytes: int = Field(
            4 << 20, ge=1024, le=1 << 30, description="Largest request body the endpoint reads (more: 413)."
        )
        port: int = Field(0, ge=0, le=65535, description="Port of the endpoint on 127.0.0.1 (0: any free port).")

    def reset(self, problem: Problem) -> list[Message]:
        raise TypeError(f"{type(self).__name__} is driven by its agent through the endpoint; it has no reset")

    def step(self, assistant_text: str) -> Step:
        raise TypeError(f"{type(self).__name__} is driven by its agent through the endpoint; it has no step")

    @abc.abstractmethod
    async def run_episode(self, episode: AgentEpisode) -> Any:
        """Run the agent on one episode; its reward: None (the Reward plugins score the
        last assistant turn), a finite number, or ``{"reward": number | None,
        "components": {name: number}}``. Raising fails the episode's trajectory. Cancelled
        at the deadline: release what it started (kill its process) before re-raising."""


def check_outcome(value: Any) -> tuple[float | None, dict[str, float]]:
    """An agent's returned reward and components, or GarbageError saying what is wrong."""
    if value is None:
        return None, {}
    if _finite(value):
        return float(value), {}
    if isinstance(value, Mapping) and set(value) <= {"reward", "components"}:
        reward = value.get("reward")
        components = value.get("components") or {}
        if reward is not None and not _finite(reward):
            raise GarbageError(f"the agent's reward {str(reward)[:80]!r} is not a finite number")
        if not isinstance(components, Mapping) or len(components) > MAX_COMPONENTS:
            raise GarbageError(f"the agent's components must be a mapping of at most {MAX_COMPONENTS} numbers")
        for key, v in components.items():
            if not isinstance(key, str) or not _finite(v):
                raise GarbageError(f"the agent's component {str(key)[:80]!r}: {str(v)[:80]!r} is not a finite number")
            if (reserved := reserved_component_error(key)) is not None:
                raise GarbageError(f"the agent's component {key!r}: {reserved}; rename the component")
        return (None if reward is None else float(reward)), {k: float(v) for k, v in components.items()}
    raise GarbageError(
        f"the agent returned {type(value).__name__} {str(value)[:80]!r}, not a reward "
        "(a number, null, or {\"reward\": number, \"components\": {...}})"
    )


def _finite(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class AgentRunner:
    """Runs episodes of one :class:`AgentEnvironment` against one generator, through one
    endpoint (started at the first episode, stopped by :meth:`close`)."""

    #: ChatTokens kept, one per distinct set of tools the agents offered.
    CHATS = 32

    def __init__(
        self,
        make_env: Callable[[], Environment],
        tokenizer: Any,
        limits: Limits,
        sampling: SamplingParams,
        options: AgentEnvironment.Options,
        *,
        model: str,
        context_length: int | None = None,
        processor: Any = None,
        image_limits: ImageLimits | None = None,
    ):
        self.make_env = make_env
        self.image_limits = image_limits
        self.tokenizer = tokenizer
        #: A VLM's processor: agents may show the model images (docs/vision.md).
        self.processor = processor
        self.limits = limits
        self.sampling = sampling
        self.options = options
        self.model = model
        self.bounds = EpisodeBounds(limits, options.max_prompt_tokens, context_length)
        self._chats: OrderedDict[str, ChatTokens] = OrderedDict()
        self._chats_lock = threading.Lock()
        self.plain = self.chat_for([])  # a template that cannot serve trajectories fails now
        self._endpoint: AgentEndpoint | None = None
        self._keys: list[str] = []
        self._endpoint_lock = threading.Lock()
        self._closed = False

    def chat_for(self, tools: list[dict[str, Any]]) -> ChatTokens:
        key = tools_key(tools)
        with self._chats_lock:
            chat = self._chats.get(key)
            if chat is None:
                chat = self._chats[key] = ChatTokens(self.tokenizer, tools)
                while len(self._chats) > self.CHATS:
                    self._chats.popitem(last=False)
            return chat

    def endpoint(self) -> AgentEndpoint:
        """The run's endpoint, started on first use."""
        from forgerl.rollouts.agent_endpoint import AgentEndpoint

        with self._endpoint_lock:
            if self._closed:
                raise RuntimeError("the agent endpoint is closed")
            if self._endpoint is None:
                self._endpoint = AgentEndpoint(
                    model=self.model, port=self.options.port, max_request_bytes=self.options.max_request_bytes
                )
                log.info("agent endpoint serving on 127.0.0.1:%d", self._endpoint.port)
                self._keys.append(self._endpoint.api_key)
            return self._endpoint

    def secrets(self) -> list[str]:
        """The keys of the endpoints this runner started (kept out of sample records)."""
        return list(self._keys)

    def close(self) -> None:
        with self._endpoint_lock:
            self._closed = True
            endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()

    async def run_many(
        self, generator: Generator, jobs: Sequence[tuple[Problem, str, int]], sampling: SamplingParams | None = None
    ) -> tuple[list[Trajectory], RequestBatcher]:
        """Episodes for ``(problem, request id, seed)`` jobs, at most ``concurrency`` at a
        time, in job order. Their calls are batched together on the endpoint's loop."""
        return await run_concurrently(self.run, generator, jobs, self.limits.concurrency, sampling)

    async def run(
        self, batcher: RequestBatcher, problem: Problem, request_id: str, seed: int,
        sampling: SamplingParams | None = None,
    ) -> Trajectory:
        endpoint = self.endpoint()
        recorder = EpisodeRecorder(
            chat_for=self.chat_for, generate=batcher.generate, bounds=self.bounds,
            sampling=sampling or self.sampling, request_id=request_id, seed=seed,
            policy_version=batcher.generator.policy_version, model=self.model, processor=self.processor,
            image_limits=self.image_limits,
        )
        loop = asyncio.get_running_loop()
        generator_failed: asyncio.Future[None] = loop.create_future()

        def on_generator_error(exc: BaseException) -> None:
            def settle() -> None:
                if not generator_failed.done():
                    generator_failed.set_exception(exc)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the episode's loop is gone: nobody waits for it any more
                pass

        recorder.on_generator_error = on_generator_error
        reward: float | None = None
        components: dict[str, float] = {}
        failure: tuple[str, str] | None = None
        env: Environment | None = None
        try:
            env = await call_bounded(self.make_env, timeout=self.limits.turn_timeout, what="agent environment init")
            if not isinstance(env, AgentEnvironment):
                raise GarbageError(f"the environment built {type(env).__name__}, not an AgentEnvironment")
            async with endpoint.serving(recorder) as base_url:
                episode = AgentEpisode(base_url, endpoint.api_key, problem, self.model, self.options.timeout)
                value = await self._drive(env, episode, generator_failed)
            reward, components = check_outcome(value)
        except _GeneratorFailed as exc:
            assert exc.__cause__ is not None, "raised from the generator's exception"
            raise exc.__cause__ from None
        except CallTimeout as exc:
            failure = ("timeout", str(exc))
        except GarbageError as exc:
            failure = ("garbage", str(exc))
        except Exception as exc:  # noqa: BLE001 - the agent's failure is its trajectory's, not the run's
            if recorder.limit is None:
                failure = ("error", f"{type(exc).__name__}: {str(exc)[:1000]}")
            else:  # it stopped on a limit the endpoint refused it over: scored like any cut trajectory
                log.info("agent stopped after the endpoint's %s limit: %s: %s", recorder.limit, type(exc).__name__, exc)
        finally:
            if generator_failed.done() and not generator_failed.cancelled():
                generator_failed.exception()  # retrieved: raised above, or moot after another error
            if env is not None:
                try:
                    await call_bounded(env.close, timeout=self.limits.turn_timeout, what="close")
                except Exception as exc:  # noqa: BLE001 - closing is best effort
                    log.warning("agent environment close failed: %s", exc)
        traj = recorder.trajectory()
        traj.rewrites = max(len(recorder.segments) - 1, 0)
        traj.dropped_tokens = recorder.dropped_tokens()
        if failure is None and not recorder.segments:
            why = "the agent ended without a call the endpoint answered (it calls its base_url with its api_key)"
            if recorder.refused:
                why += f"; {recorder.refused} refused, the last: {recorder.last_refusal[:300]}"
            failure = ("error", why)
        if failure is not None:
            fail_trajectory(traj, failure[0], failure[1])  # type: ignore[arg-type]
        else:
            traj.reward, traj.components = reward, components
        if not traj.prompt_ids:
            # No call: a minimal prompt keeps the sample well-formed (nothing is trained).
            traj.prompt_ids = self.plain.ids(str(problem.prompt)[:200] or " ") or [0]
        return traj

    async def _drive(self, env: AgentEnvironment, episode: AgentEpisode, generator_failed: asyncio.Future[None]) -> Any:
        """The agent's result; CallTimeout past the deadline; _GeneratorFailed when the
        generator failed one of its calls (the agent is cancelled either way)."""
        agent = asyncio.ensure_future(env.run_episode(episode))
        done, _ = await asyncio.wait({agent, generator_failed}, timeout=episode.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if generator_failed in done or agent not in done:
            agent.cancel()
            await asyncio.wait({agent}, timeout=CANCEL_GRACE)
            if not agent.done():
                log.warning("agent %s did not stop within %g s of being cancelled", type(env).__name__, CANCEL_GRACE)
            elif not agent.cancelled():
                agent.exception()  # retrieved: the episode's outcome is decided above
            if generator_failed in done:
                raise _GeneratorFailed() from generator_failed.exception()
            raise CallTimeout(f"the agent did not end within {episode.timeout:g} s")
        return agent.result()

    def extra_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        n = max(len(trajectories), 1)
        return {
            "env/agent_rewrites_mean": sum(t.rewrites for t in trajectories) / n,
            "env/agent_dropped_tokens_mean": sum(t.dropped_tokens for t in trajectories) / n,
        }


class _GeneratorFailed(Exception):
    """Carries the generator's exception past the handlers that contain agent failures."""
