"""The ``mixture`` task: several datasets drawn from with weights, each problem tagged with
its source (docs/data.md).

Each source is a ``dataset`` task of its own (files, folders, cached names, streaming, its
own held-out rows). Draws follow smooth weighted round-robin: after ``n`` draws each source
has given ``n * weight / total`` problems to within one, in an interleaved order that
depends on the weights only, so the position is each source's count and its own state,
and a resumed run draws exactly what an unbroken one would have.

Every problem carries its source's name under :data:`forgerl.types.SOURCE_KEY`: rewards
configured with ``sources: [NAME]`` score only that source's problems (math rows by
``math_answer``, code rows by ``code``), and the metrics and ``forge report`` break the
rewards down by source (``source/<name>/...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pydantic import Field, model_validator

from forgerl.errors import ConfigError
from forgerl.interfaces import Task
from forgerl.options import OptionsModel
from forgerl.types import SOURCE_KEY, Problem

from .dataset import DatasetTask


class Source(OptionsModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The source's name (letters, digits, _ . -): rewards' sources and the metrics use it.",
    )
    weight: float = Field(1.0, gt=0, le=1e6, description="Its share of the draws, relative to the others'.")
    dataset: DatasetTask.Options = Field(
        description="Where its problems come from: the dataset task's options."
    )


class MixtureTask(Task):
    name = "mixture"
    description = "several datasets drawn from with weights, each with its own rewards"

    class Options(OptionsModel):
        sources: list[Source] = Field(min_length=1, description="The datasets mixed, with their weights.")

        @model_validator(mode="after")
        def _unique(self) -> MixtureTask.Options:
            names = [s.name for s in self.sources]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"two sources are named {dupes[0]!r}: each source needs its own name")
            return self

    @classmethod
    def source_names(cls, options: Any) -> list[str] | None:
        return [s.name for s in options.sources]

    @staticmethod
    def preflight(options: MixtureTask.Options) -> None:
        for source in options.sources:
            try:
                DatasetTask.preflight(source.dataset)
            except ConfigError as exc:
                raise ConfigError(f"source {source.name!r}: {exc}") from None

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        self.tasks = {}
        for i, source in enumerate(options.sources):
            try:
                # Each source its own seed: two sources of the same file are not shuffled alike.
                self.tasks[source.name] = DatasetTask(source.dataset, seed=self.seed * 1009 + i)
            except ConfigError as exc:
                raise ConfigError(f"source {source.name!r}: {exc}") from None
        self.weights = {s.name: s.weight for s in options.sources}
        self.drawn = dict.fromkeys(self.weights, 0)

    # ------------------------------------------------------------------ Task

    def next_problems(self, n: int) -> list[Problem]:
        order = [self._pick() for _ in range(n)]
        taken = {name: iter(self.tasks[name].next_problems(order.count(name))) for name in set(order)}
        return [_tagged(next(taken[name]), name) for name in order]

    def eval_problems(self) -> list[Problem]:
        return [_tagged(p, name) for name, task in self.tasks.items() for p in task.eval_problems()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "drawn": dict(self.drawn),
            "sources": {name: task.state_dict() for name, task in self.tasks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ConfigError(
                f"task mixture: the saved state is for seed {state['seed']}, this run uses seed {self.seed}"
            )
        saved = set(state.get("sources", {}))
        if saved != set(self.tasks):
            raise ConfigError(
                f"task mixture: the checkpoint mixes {', '.join(sorted(saved)) or 'nothing'}, this run "
                f"{', '.join(sorted(self.tasks))}; resume with the same sources"
            )
        for name, task in self.tasks.items():
            try:
                task.load_state_dict(state["sources"][name])
            except ConfigError as exc:
                raise ConfigError(f"source {name!r}: {exc}") from None
        self.drawn = {name: int(state["drawn"][name]) for name in self.tasks}

    # ------------------------------------------------------------- helpers

    def _pick(self) -> str:
        """The source furthest behind its share: the smallest ``(drawn + 1) / weight``, ties
        to the first listed. A function of the counts only, so resuming needs nothing else."""
        name = min(self.weights, key=lambda s: (self.drawn[s] + 1) / self.weights[s])
        self.drawn[name] += 1
        return name


def _tagged(problem: Problem, source: str) -> Problem:
    """``problem`` with its source in the metadata and the source in its id (two sources'
    ids may coincide). A row's own value under the key is overwritten: data cannot claim
    another source's rewards."""
    metadata = {**problem.metadata, SOURCE_KEY: source}
    return replace(problem, id=f"{source}/{problem.id}", metadata=metadata)
