"""Held-out evaluation: the task's eval split sampled at ``loop.eval_temperature``, scored
by the run's rewards (or the environment), one code path for the run's own evaluation and
for ``forge eval`` (:mod:`forgerl.runloop.eval_run`).

A run evaluates one sample per problem (or one whole trajectory where an environment runs
the episodes), summed up as ``eval/accuracy``, ``eval/reward``, ``eval/samples`` and the
mean of every reward component over the held-out problems, ``eval/reward/<name>`` (an
environment's ``used_tool``: the tool-call rate on them). ``forge eval`` draws ``k``
samples per problem through :func:`score_samples`: sample 0 of a problem is exactly the
sample the run's own evaluation draws (same request, same seed), the others differ only
in their seed.

A sample is correct when the primary (first) reward says so: its ``correct``
sub-component where it reports one, else a full score. A trajectory whose environment
gave the reward is judged by the environment's ``correct`` component instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from forgerl.errors import ImageError
from forgerl.rollouts.rollout import sampling_seed
from forgerl.types import GenerationRequest, Problem, RewardInput, RewardResult, SamplingParams, source_of

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Generator
    from forgerl.rollouts.env_rollouts import EnvironmentRollouts
    from forgerl.rollouts.rollout import Tokenizing

#: Seeds of a problem's further samples step by this prime from its first sample's seed.
_SAMPLE_STRIDE = 104_729


@dataclass
class EvalSample:
    """One scored held-out sample: problem ``group`` (its index in the held-out list),
    sample ``index`` of that problem."""

    group: int
    index: int
    problem: Problem
    completion: str
    result: RewardResult
    correct: float
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: The generator's completion (a trajectory's, where an environment ran), its prompt's
    #: tokens and a trajectory's chat messages: what sample records are made of.
    output: Any = None
    prompt_ids: Sequence[int] = ()
    messages: list[dict[str, Any]] | None = None


#: Where an evaluation hands its samples (:meth:`forgerl.samples.capture.Capture.evaluation`'s
#: keywords: problems, prompt_ids, completions, scores, correct, messages).
Record = Callable[..., Any]


def eval_sampling(cfg: RunConfig) -> SamplingParams:
    """The run's sampling settings at the eval temperature."""
    s = cfg.loop.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=cfg.loop.eval_temperature, top_p=s.top_p, top_k=s.top_k)


def sample_seed(cfg: RunConfig, group: int, index: int) -> int:
    """The seed of sample ``index`` of held-out problem ``group``."""
    return sampling_seed(cfg.loop.seed + 1, -1, group) + _SAMPLE_STRIDE * index


def _request_id(group: int, index: int) -> str:
    return f"eval-{group}" if index == 0 else f"eval-{group}-{index}"


def score_samples(
    cfg: RunConfig,
    problems: Sequence[Problem],
    pairs: Sequence[tuple[int, int]],
    generator: Generator,
    rewards: Any,
    tokenizing: Tokenizing | None = None,
    environment: EnvironmentRollouts | None = None,
) -> list[EvalSample]:
    """Sample and score ``(group, index)`` pairs of the held-out ``problems``: single
    completions through ``tokenizing``, or whole trajectories through ``environment`` (for
    the problems it takes: a mixture's other sources are single-turn). In ``pairs``' order."""
    if environment is not None:
        through_env = [pair for pair in pairs if environment.takes(problems[pair[0]])]
        if len(through_env) == len(pairs):
            return _score_trajectories(cfg, problems, pairs, generator, rewards, environment)
        single = [pair for pair in pairs if not environment.takes(problems[pair[0]])]
        done = {
            (s.group, s.index): s
            for s in (
                *(_score_trajectories(cfg, problems, through_env, generator, rewards, environment) if through_env else ()),
                *score_samples(cfg, problems, single, generator, rewards, tokenizing),
            )
        }
        return [done[pair] for pair in pairs]
    assert tokenizing is not None, "single-turn evaluation tokenizes its prompts"
    sampling = eval_sampling(cfg)
    rendered: dict[int, tuple[list[int], Any]] = {}
    failed: dict[int, str] = {}
    for g in dict.fromkeys(g for g, _ in pairs):
        try:
            rendered[g] = tokenizing.render(problems[g])
        except ImageError as exc:
            # A bad image fails its problem's samples (scored 0), not the evaluation.
            failed[g] = str(exc)
    prompts = {g: ids for g, (ids, _) in rendered.items()}
    bad = [(g, j) for g, j in pairs if g in failed]
    pairs = [(g, j) for g, j in pairs if g not in failed]
    requests = [
        GenerationRequest(request_id=_request_id(g, j), prompt_token_ids=prompts[g], n=1,
                          sampling=replace(sampling, seed=sample_seed(cfg, g, j)), images=rendered[g][1])
        for g, j in pairs
    ]  # fmt: skip

    async def go() -> tuple[list[Any], list[RewardResult]]:
        results = await generator.generate(requests)
        inputs = [RewardInput(problems[g], r[0].text, r[0].finish_reason) for (g, _), r in zip(pairs, results)]
        return results, await rewards.score(inputs)

    results, scores = asyncio.run(go()) if pairs else ([], [])
    samples = [
        EvalSample(g, j, problems[g], r[0].text, s, is_correct(s, cfg, source_of(problems[g])), r[0].finish_reason, len(prompts[g]),
                   len(r[0].token_ids), r[0].policy_version, output=r[0], prompt_ids=prompts[g])
        for (g, j), r, s in zip(pairs, results, scores)
    ]  # fmt: skip
    samples += [
        EvalSample(g, j, problems[g], "", RewardResult(0.0, failed=True, error=failed[g]), 0.0, "abort")
        for g, j in bad
    ]
    return sorted(samples, key=lambda e: (e.group, e.index)) if bad else samples


def _score_trajectories(
    cfg: RunConfig,
    problems: Sequence[Problem],
    pairs: Sequence[tuple[int, int]],
    generator: Generator,
    rewards: Any,
    environment: EnvironmentRollouts,
) -> list[EvalSample]:
    jobs = [(problems[g], _request_id(g, j), sample_seed(cfg, g, j)) for g, j in pairs]
    turn = replace(eval_sampling(cfg), max_tokens=environment.runner.limits.max_turn_tokens)
    scored, _ = asyncio.run(environment.scored(generator, jobs, rewards.score, turn))
    out = []
    for (g, j), s in zip(pairs, scored):
        t = s.trajectory
        if t.reward is not None:  # the environment's own verdict
            correct = float(s.result.components.get("correct", float(s.result.value >= 1.0)))
        else:
            correct = is_correct(s.result, cfg, source_of(problems[g]))
        out.append(EvalSample(g, j, problems[g], t.completion.text or t.last_text, s.result, correct,
                              t.completion.finish_reason, len(t.prompt_ids), len(t.completion.token_ids),
                              t.completion.policy_version, {"turns": t.turns, "failure": t.failure},
                              output=t.completion, prompt_ids=t.prompt_ids, messages=t.messages or None))  # fmt: skip
    return out


def evaluate_samples(
    cfg: RunConfig, problems: list[Any], generator: Generator, rewards: Any, tokenizing: Tokenizing,
    record: Record | None = None, environment: EnvironmentRollouts | None = None,
) -> dict[str, float]:
    """One sample per problem (one whole trajectory where ``environment`` takes the
    problem), scored: the eval row. ``record`` gets the samples."""
    pairs = [(i, 0) for i in range(len(problems))]
    scored = score_samples(cfg, problems, pairs, generator, rewards, tokenizing, environment)
    return row_of(_recorded(scored, record))


def _recorded(samples: list[EvalSample], record: Record | None) -> list[EvalSample]:
    if record is not None:
        record(problems=[s.problem for s in samples], prompt_ids=[s.prompt_ids for s in samples],
               completions=[s.output for s in samples], scores=[s.result for s in samples],
               correct=[s.correct for s in samples], messages=[s.messages for s in samples])  # fmt: skip
    return samples


def row_of(samples: Sequence[EvalSample]) -> dict[str, float]:
    """The eval row of scored samples."""
    return _row([s.correct for s in samples], [s.result.value for s in samples],
                [s.result.components for s in samples], [source_of(s.problem) for s in samples])  # fmt: skip


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
