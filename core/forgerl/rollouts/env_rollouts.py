"""Rollout batches and evaluations made of trajectories, when the run has an environment.

A GRPO group is the ``group_size`` trajectories of one problem, each with its own
environment instance. A trajectory's reward is the environment's (when it gives one), else
the run's Reward plugins' score of its last assistant turn; a trajectory the environment
failed scores ``loop.failed_reward``, is counted (``env/failed*``) and recorded with its
reason in ``<run_dir>/environment_failures.jsonl``.

Trajectories come from a :class:`TrajectoryRunner` (the run steps the environment) or,
for an :class:`~forgerl.rollouts.agent_runner.AgentEnvironment`, an
:class:`~forgerl.rollouts.agent_runner.AgentRunner` (an agent drives the run's endpoint).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forgerl.errors import PluginError
from forgerl.rollouts.agent_runner import AgentEnvironment, AgentRunner
from forgerl.rollouts.bounded import abandoned_threads
from forgerl.rollouts.trajectory import Limits, RequestBatcher, Trajectory, TrajectoryRunner
from forgerl.types import Episode, Problem, RewardInput, RewardResult, SamplingParams, source_of

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator
    from forgerl.registry.plugins import Registry

FAILURES_FILE = "environment_failures.jsonl"

Score = Callable[[list[RewardInput]], Awaitable[list[RewardResult]]]


@dataclass
class Scored:
    trajectory: Trajectory
    result: RewardResult


class Runner(Protocol):
    """What makes trajectories: :class:`TrajectoryRunner` (environments stepped by the run)
    or :class:`forgerl.rollouts.agent_runner.AgentRunner` (agents that drive the run's endpoint)."""

    limits: Limits

    async def run_many(
        self, generator: Generator, jobs: Sequence[tuple[Problem, str, int]], sampling: SamplingParams | None = None
    ) -> tuple[list[Trajectory], RequestBatcher]: ...

    def extra_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]: ...

    def close(self) -> None: ...


class EnvironmentRollouts:
    def __init__(
        self, runner: Runner, *, failed_reward: float, run_dir: Path | None = None,
        sources: Sequence[str] | None = None,
    ):
        self.runner = runner
        self.failed_reward = failed_reward
        self.run_dir = run_dir
        #: The mixture sources whose problems run through the environment (None: every
        #: problem); the others are single-turn (``environment.sources``).
        self.sources = frozenset(sources) if sources is not None else None

    def takes(self, problem: Problem) -> bool:
        """Whether ``problem`` runs through the environment (else it is single-turn)."""
        return self.sources is None or source_of(problem) in self.sources

    @classmethod
    def from_config(
        cls, config: RunConfig, registry: Registry, tokenizer: Any, run_dir: Path | None, *,
        context_length: int | None = None, processor: Any = None,
    ) -> EnvironmentRollouts | None:
        """None when the config names no environment (single-turn rollouts).
        ``context_length``: the model's, where known (it bounds an agent's calls: beyond
        it the generator would fail the run, not the call)."""
        env = config.environment
        if env.name is None:
            return None
        backend = registry.require("environment", env.name)
        options = backend.validate_options(env.options)  # once: each trajectory's instance reuses it
        sampling = config.loop.sampling
        limits = Limits(
            max_turns=env.max_turns,
            max_total_tokens=env.max_total_tokens,
            max_turn_tokens=env.max_turn_tokens or sampling.max_tokens,
            turn_timeout=env.turn_timeout,
            concurrency=env.concurrency,
        )
        turn_sampling = SamplingParams(
            max_tokens=limits.max_turn_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        env_class = backend.load_factory()
        runner: Runner
        if isinstance(env_class, type) and issubclass(env_class, AgentEnvironment):
            if not isinstance(options, AgentEnvironment.Options):
                raise PluginError(f"environment {env.name!r}: an AgentEnvironment's Options must subclass "
                                  "AgentEnvironment.Options")
            runner = AgentRunner(
                lambda: backend.build(options), tokenizer, limits, turn_sampling, options,
                model=config.model.name, context_length=context_length, processor=processor,
                image_limits=config.images.limits(),
            )
        else:
            runner = TrajectoryRunner(
                lambda: backend.build(options),
                env_class,  # type: ignore[arg-type]
                tokenizer,
                limits,
                turn_sampling,
                processor=processor,
                image_limits=config.images.limits(),
            )
        return cls(runner, failed_reward=config.loop.failed_reward, run_dir=run_dir, sources=env.sources)

    def close(self) -> None:
        """Release what the runner holds (an agent endpoint's server). Idempotent."""
        self.runner.close()

    def secrets(self) -> list[str]:
        """Keys the runner hands out (an agent endpoint's): never written into sample records."""
        secrets = getattr(self.runner, "secrets", None)
        return list(secrets()) if callable(secrets) else []

    async def scored(
        self, generator: Generator, jobs: Sequence[tuple[Problem, str, int]], score: Score,
        sampling: SamplingParams | None = None,
    ) -> tuple[list[Scored], dict[str, float]]:
        """Run and score trajectories for ``(problem, request id, seed)`` jobs."""
        trajectories, batcher = await self.runner.run_many(generator, jobs, sampling)
        to_score = [
            i for i, t in enumerate(trajectories) if t.failure is None and t.reward is None
        ]
        scores = await score([
            RewardInput(jobs[i][0], trajectories[i].last_text, trajectories[i].completion.finish_reason)
            for i in to_score
        ]) if to_score else []
        results: list[RewardResult] = []
        by_index = dict(zip(to_score, scores))
        for i, t in enumerate(trajectories):
            if t.failure is not None:
                results.append(RewardResult(self.failed_reward, failed=True, error=t.failure))
            elif t.reward is not None:
                results.append(RewardResult(t.reward, dict(t.components)))
            else:
                results.append(by_index[i])
        self._record_failures(jobs, trajectories)
        metrics = _metrics(trajectories, batcher.requests, batcher.batches)
        metrics.update(self.runner.extra_metrics(trajectories))
        return [Scored(t, r) for t, r in zip(trajectories, results)], metrics

    async def batch(
        self, generator: Generator, problems: Sequence[Problem], *, index: int, seeds: Sequence[int],
        group_size: int, score: Score, groups: Sequence[int] | None = None,
    ) -> tuple[list[Episode], dict[str, float], float]:
        """The episodes of one rollout batch, its metrics and its generation seconds.
        ``groups``: each problem's group number in the batch (default its position)."""
        numbers = list(groups) if groups is not None else list(range(len(problems)))
        jobs = [
            (p, f"b{index}-g{numbers[g]}-m{m}", seeds[g] + 104_729 * m)
            for g, p in enumerate(problems)
            for m in range(group_size)
        ]
        t0 = time.perf_counter()
        scored, metrics = await self.scored(generator, jobs, score)
        episodes = [
            Episode(
                problem=jobs[k][0],
                group_id=numbers[k // group_size],
                prompt_token_ids=s.trajectory.prompt_ids,
                completion=s.trajectory.completion,
                reward=float(s.result.value),
                reward_components=dict(s.result.components),
                reward_failed=bool(s.result.failed),
                error=s.result.error if s.result.failed else None,
                messages=s.trajectory.messages or None,
                images=s.trajectory.images,
            )
            for k, s in enumerate(scored)
        ]
        return episodes, metrics, time.perf_counter() - t0

    def _record_failures(self, jobs: Sequence[tuple[Problem, str, int]], trajectories: list[Trajectory]) -> None:
        if self.run_dir is None:
            return
        from forgerl.rundirs.runs import append_line

        for (problem, request_id, _), t in zip(jobs, trajectories):
            if t.failure is not None:
                line = {"time": time.time(), "request": request_id, "problem": problem.id,
                        "kind": t.failure_kind, "reason": t.failure[:2000]}
                append_line(self.run_dir / FAILURES_FILE, (json.dumps(line) + "\n").encode())


def _metrics(trajectories: list[Trajectory], requests: int, batches: int) -> dict[str, float]:
    n = max(len(trajectories), 1)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / n

    sampled = [sum(t.completion.mask or []) for t in trajectories]
    out = {
        "env/failed": float(sum(t.failure is not None for t in trajectories)),
        "env/turns_mean": mean([t.turns for t in trajectories]),
        "env/observations_mean": mean([t.observations for t in trajectories]),
        "env/limit_frac": mean([t.limit is not None for t in trajectories]),
        "env/sampled_tokens_mean": mean(sampled),
        "env/env_tokens_mean": mean([len(t.completion.token_ids) - s for t, s in zip(trajectories, sampled)]),
        "env/abandoned_threads": float(abandoned_threads()),
        "env/generate_batch_mean": requests / max(batches, 1),
    }
    for kind in ("timeout", "error", "garbage"):
        out[f"env/failed_{kind}"] = float(sum(t.failure_kind == kind for t in trajectories))
    return out
