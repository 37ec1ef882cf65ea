"""Held-out evaluation: the task's eval split sampled at ``loop.eval_temperature`` (one
sample per problem, or one whole trajectory where an environment runs the episodes),
scored by the run's rewards, and summed up as ``eval/accuracy``, ``eval/reward``,
``eval/samples`` and the mean of every reward component over the held-out problems,
``eval/reward/<name>`` (an environment's ``used_tool``: the tool-call rate on them).

A sample is correct when the primary (first) reward says so: its ``correct``
sub-component where it reports one, else a full score. A trajectory whose environment
gave the reward is judged by the environment's ``correct`` component instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from forgerl.rollouts.rollout import sampling_seed
from forgerl.types import GenerationRequest, RewardInput, RewardResult, SamplingParams, source_of

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator
    from forgerl.rollouts.env_rollouts import EnvironmentRollouts
    from forgerl.rollouts.rollout import Tokenizing


def eval_sampling(cfg: RunConfig) -> SamplingParams:
    """The run's sampling settings at the eval temperature."""
    s = cfg.loop.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=cfg.loop.eval_temperature, top_p=s.top_p, top_k=s.top_k)


def evaluate_samples(
    cfg: RunConfig, problems: list[Any], generator: Generator, rewards: Any, tokenizing: Tokenizing
) -> dict[str, float]:
    """One sample per problem, scored: the eval row."""
    sampling = eval_sampling(cfg)
    requests = [
        GenerationRequest(
            request_id=f"eval-{i}",
            prompt_token_ids=tokenizing.prompt_ids(p),
            n=1,
            sampling=replace(sampling, seed=sampling_seed(cfg.loop.seed + 1, -1, i)),
        )
        for i, p in enumerate(problems)
    ]

    async def go() -> list[RewardResult]:
        results = await generator.generate(requests)
        inputs = [RewardInput(p, r[0].text, r[0].finish_reason) for p, r in zip(problems, results)]
        return await rewards.score(inputs)

    scores = asyncio.run(go())
    sources = [source_of(p) for p in problems]
    correct = [is_correct(s, cfg, src) for s, src in zip(scores, sources, strict=True)]
    return _row(correct, [s.value for s in scores], [s.components for s in scores], sources)


def evaluate_trajectories(
    cfg: RunConfig, problems: list[Any], generator: Generator, rewards: Any, environment: EnvironmentRollouts
) -> dict[str, float]:
    """One whole trajectory per problem, scored: the eval row."""
    jobs = [(p, f"eval-{i}", sampling_seed(cfg.loop.seed + 1, -1, i)) for i, p in enumerate(problems)]
    turn = replace(eval_sampling(cfg), max_tokens=environment.runner.limits.max_turn_tokens)
    scored, _ = asyncio.run(environment.scored(generator, jobs, rewards.score, turn))
    correct = []
    sources = [source_of(p) for p in problems]
    for s, source in zip(scored, sources, strict=True):
        if s.trajectory.reward is not None:  # the environment's own verdict
            correct.append(float(s.result.components.get("correct", float(s.result.value >= 1.0))))
        else:
            correct.append(is_correct(s.result, cfg, source))
    return _row(correct, [s.result.value for s in scored], [s.result.components for s in scored], sources)


def is_correct(score: Any, cfg: RunConfig, source: str | None = None) -> float:
    """Whether the primary reward calls ``score`` correct (1.0 or 0.0): the first reward, or
    for a problem of a mixture source, the first reward that scores that source."""
    primary = next(
        (r.name for r in cfg.rewards if source is None or r.sources is None or source in r.sources),
        cfg.rewards[0].name,
    )
    comps = score.components
    if f"{primary}/correct" in comps:
        return float(comps[f"{primary}/correct"])
    return float(comps.get(primary, 0.0) >= 1.0)


def mean(xs: Iterable[Any]) -> float:
    values = [float(x) for x in xs]
    return sum(values) / len(values) if values else 0.0


def _row(
    correct: list[float],
    rewards: list[float],
    components: list[Mapping[str, float]],
    sources: list[str | None] | None = None,
) -> dict[str, float]:
    # A component a sample does not report counts 0 (a trajectory that failed reports none),
    # as the training rows' reward/<name> count it.
    names = dict.fromkeys(name for c in components for name in c)
    by_source: dict[str, list[int]] = {}
    for i, source in enumerate(sources or ()):
        if source is not None:
            by_source.setdefault(source, []).append(i)
    return {
        "eval/accuracy": mean(correct),
        "eval/reward": mean(rewards),
        "eval/samples": len(correct),
        **{f"eval/reward/{name}": mean(c.get(name, 0.0) for c in components) for name in names},
        **{f"eval/source/{s}/accuracy": mean(correct[i] for i in idx) for s, idx in sorted(by_source.items())},
        **{f"eval/source/{s}/reward": mean(rewards[i] for i in idx) for s, idx in sorted(by_source.items())},
    }
