"""A step's reward metrics that depend on where problems came from: each component's mean
over the samples it scored, and the breakdown by mixture source (``source/<name>/...``)."""

from __future__ import annotations

from collections.abc import Sequence

from forgerl.runloop.evaluation import mean
from forgerl.types import Episode, source_of


def component_mean(episodes: Sequence[Episode], name: str) -> float:
    """The mean of component ``name``. A sample of a mixture source counts only where a
    reward of its source made the component (a math reward's mean is not diluted by the code
    rows it never saw); every other sample counts, as 0 where the component is missing."""
    owner = name.split("/", 1)[0]
    return mean(
        e.reward_components.get(name, 0.0)
        for e in episodes
        if source_of(e.problem) is None or name in e.reward_components or owner in e.reward_components
    )


def per_source_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``source/<name>/reward`` (the mean total reward), ``source/<name>/<reward>`` (each of
    its rewards' means) and ``source_samples/<name>`` (its samples) for every source in the step."""
    by_source: dict[str, list[Episode]] = {}
    for e in episodes:
        source = source_of(e.problem)
        if source is not None:
            by_source.setdefault(source, []).append(e)
    row: dict[str, float] = {}
    for source, eps in sorted(by_source.items()):
        row[f"source/{source}/reward"] = mean(e.reward for e in eps)
        row[f"source_samples/{source}"] = float(len(eps))
        for name in sorted({n for e in eps for n in e.reward_components if "/" not in n}):
            row[f"source/{source}/{name}"] = component_mean(eps, name)
    return row
