"""reasoning-gym's procedural datasets as a forgerl task and their scorers as a reward.

The task draws from one or several reasoning-gym datasets (``basic_arithmetic``,
``chain_sum``, ``countdown``, ... : ``reasoning_gym.factory.DATASETS``), each with its own
generator config and weight. A problem's metadata names where it came from (dataset name,
config, seed, size, index), never the generated entry itself: the reward regenerates the
entry from that recipe (a procedural dataset's item is a function of its seed and index)
and scores the completion's ``<answer>`` with the dataset's own ``score_answer``. So the
metadata stays small and JSON, and a checkpoint or a reward worker needs nothing else.

Draws follow smooth weighted round-robin over the datasets and each dataset is visited in
index order, epoch after epoch (``size`` items each), so the position is a count per
dataset and resuming is exact. The held-out problems come from another seed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.interfaces import Reward, Task
from forgerl.types import Problem, RewardInput, RewardResult

#: The metadata key of a problem's recipe.
KEY = "reasoning_gym"
#: Added to the run's seed for the held-out items, so they are not training items.
EVAL_SEED_OFFSET = 1_000_003


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise BackendUnavailable("reasoning_gym needs reasoning-gym: pip install reasoning-gym") from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_items: tuple[tuple[str, Any], ...], seed: int, size: int) -> Any:
    """The reasoning-gym dataset of this recipe, made once per process."""
    rg = _rg()
    try:
        return rg.create_dataset(name, seed=seed, size=size, **dict(config_items))
    except (ValueError, TypeError, AssertionError) as exc:
        known = ", ".join(sorted(rg.factory.DATASETS))
        hint = f"; datasets: {known}" if name not in rg.factory.DATASETS else ""
        raise ConfigError(f"reasoning_gym dataset {name!r}: {exc}{hint}") from None


def _frozen(config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="A reasoning-gym dataset (reasoning_gym.factory.DATASETS).")
    weight: float = Field(1.0, gt=0, le=1e6, description="Its share of the draws.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="Its generator's options (difficulty, ...)."
    )


class ReasoningGymTask(Task):
    name = "reasoning_gym"
    description = "reasoning-gym's procedural tasks (with the reasoning_gym reward)"
    requires = ("reasoning_gym",)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        datasets: list[DatasetSpec] = Field(
            default_factory=lambda: [DatasetSpec(name="basic_arithmetic")],
            min_length=1,
            description="The reasoning-gym datasets drawn from, with weights and configs.",
        )
        size: int = Field(10_000, ge=1, le=10_000_000, description="Training items per dataset (an epoch).")
        eval_size: int = Field(64, ge=0, le=100_000, description="Held-out items per dataset.")
        system_prompt: str | None = Field(
            "default",
            description="A reasoning-gym system prompt by name (default, simple, direct, ...), other text "
            "as the prompt itself, or null for none.",
        )

        @model_validator(mode="after")
        def _unique(self) -> ReasoningGymTask.Options:
            names = [d.name for d in self.datasets]
            if len(set(names)) != len(names):
                raise ValueError("each dataset once: list a dataset under datasets only once")
            return self

    @staticmethod
    def preflight(options: ReasoningGymTask.Options) -> None:
        ReasoningGymTask(options).next_problems(len(options.datasets))

    def __init__(self, options: Options, *, seed: int = 0):
        self.options = options
        self.seed = int(seed)
        self.system = _system_prompt(options.system_prompt)
        for spec in options.datasets:  # a bad name or config fails here, in one line
            _dataset(spec.name, _frozen(spec.config), self.seed, options.size)
        self.drawn = {d.name: 0 for d in options.datasets}
        self.weights = {d.name: d.weight for d in options.datasets}
        self.specs = {d.name: d for d in options.datasets}

    def next_problems(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            name = min(self.weights, key=lambda s: (self.drawn[s] + 1) / self.weights[s])
            index = self.drawn[name] % self.options.size
            self.drawn[name] += 1
            out.append(self._problem(self.specs[name], self.seed, self.options.size, index))
        return out

    def eval_problems(self) -> list[Problem]:
        n = self.options.eval_size
        seed = self.seed + EVAL_SEED_OFFSET
        return [self._problem(spec, seed, n, i) for spec in self.options.datasets for i in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "drawn": dict(self.drawn)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(
                f"reasoning_gym: the saved state is for seed {state['seed']}, this run uses {self.seed}"
            )
        drawn = state.get("drawn", {})
        if set(drawn) != set(self.drawn):
            raise ConfigError(
                f"reasoning_gym: the checkpoint draws from {', '.join(sorted(drawn))}, this run from "
                f"{', '.join(sorted(self.drawn))}; resume with the same datasets"
            )
        self.drawn = {k: int(v) for k, v in drawn.items()}

    def _problem(self, spec: DatasetSpec, seed: int, size: int, index: int) -> Problem:
        entry = _dataset(spec.name, _frozen(spec.config), seed, size)[index]
        prompt = [{"role": "user", "content": str(entry["question"])}]
        if self.system:
            prompt.insert(0, {"role": "system", "content": self.system})
        recipe = {"dataset": spec.name, "config": spec.config, "seed": seed, "size": size, "index": index}
        return Problem(
            id=f"{spec.name}:{seed}:{index}",
            prompt=prompt,
            answer=str(entry["answer"]),
            metadata={KEY: recipe},
        )


def _system_prompt(value: str | None) -> str | None:
    if value is None:
        return None
    prompts = _rg().utils.SYSTEM_PROMPTS
    return str(prompts[value]) if value in prompts else value


class ReasoningGymReward(Reward):
    """The dataset's own ``score_answer`` on the completion's ``<answer>...</answer>`` (the
    last one); 0 without one. Components: ``answered`` (a tagged answer was there)."""

    name = "reasoning_gym"
    description = "scores a reasoning_gym problem with its dataset's own scorer"
    requires = ("reasoning_gym",)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        tag: str = Field(
            "answer", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$", description="The tag holding the answer."
        )

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()
        # Imported here, not at the first score: a reward worker builds its reward when it
        # starts, while the run loads its model, and reasoning-gym takes seconds to import
        # (every generator), which would otherwise count against the first sample's timeout.
        _rg()

    def score(self, sample: RewardInput) -> RewardResult:
        recipe = sample.problem.metadata.get(KEY)
        if not isinstance(recipe, Mapping):
            raise ValueError("not a reasoning_gym problem: its metadata has no reasoning_gym recipe")
        entry = _dataset(str(recipe["dataset"]), _frozen(recipe.get("config") or {}),
                         int(recipe["seed"]), int(recipe["size"]))[int(recipe["index"])]  # fmt: skip
        answer = _rg().utils.extract_answer(sample.completion_text, tag_name=self.options.tag)
        if answer is None:
            return RewardResult(value=0.0, components={"answered": 0.0})
        dataset = _dataset(str(recipe["dataset"]), _frozen(recipe.get("config") or {}),
                           int(recipe["seed"]), int(recipe["size"]))  # fmt: skip
        value = float(dataset.score_answer(answer=answer, entry=entry))
        return RewardResult(value=value, components={"answered": 1.0})
