"""The run configuration.

One :class:`RunConfig` describes a run. Each backend choice names the backend and carries
its options block, which the backend's own options model validates (unknown keys
refused, ranges checked) in :func:`resolve`. Precedence: defaults < YAML file < named
flags (``--generator``, ``--steps``, ...) < ``--set`` values (applied last, so they can
refine what a flag selected).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from forgerl.algorithms.config import AlgorithmConfig
from forgerl.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.plugins import Registry

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackendChoice(_Strict):
    """A backend selected by name, with its options block (validated by the backend)."""

    name: str = Field(description="Backend name, as listed by `forge plugins list`.")
    options: dict[str, Any] = Field(default_factory=dict, description="The backend's own options.")


class GeneratorChoice(BackendChoice):
    name: str = Field("auto", description="Generator backend; `auto` picks vllm when installed, else hf.")


class TrainerChoice(BackendChoice):
    name: str = Field("fsdp", description="Trainer backend.")
    ranks: int = Field(1, ge=1, description="Trainer processes (torch.distributed ranks).")


class TransportChoice(BackendChoice):
    name: str = Field("shm", description="Weight transport from trainer to generators.")
    timeout: float = Field(120.0, gt=0, description="Seconds a weight transfer may take before it fails.")


class SchedulerChoice(BackendChoice):
    name: str = Field("local", description="Where the run's processes run.")


class TaskChoice(BackendChoice):
    name: str = Field("arithmetic", description="Source of prompts and reference answers.")


class RewardChoice(BackendChoice):
    weight: float = Field(1.0, description="Weight of this reward in the total (a weighted sum).")


class ModelConfig(_Strict):
    name: str = Field(
        DEFAULT_MODEL,
        description="A named model (`forge plugins list` shows them: tiny, smollm2-135m-instruct), "
        "a local Hugging Face folder, or a hub id where the network allows.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of a named model source.")


class SamplingConfig(_Strict):
    max_tokens: int = Field(64, ge=1, description="Most tokens per completion.")
    temperature: float = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")


class LoopConfig(_Strict):
    steps: int = Field(20, ge=0, description="Training steps (optimiser updates) in the run.")
    prompts_per_step: int = Field(8, ge=1, description="Prompt groups per training batch.")
    group_size: int = Field(4, ge=1, description="Completions sampled per prompt (GRPO group).")
    max_staleness: int = Field(
        0, ge=0, description="Oldest policy version lag a sample may have when trained on; 0 = on-policy."
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only at start and end).")
    eval_size: int | None = Field(None, ge=1, description="Evaluate on the first N held-out problems.")
    eval_temperature: float = Field(0.0, ge=0, description="Sampling temperature for evaluation (0 greedy).")
    eval_at_start: bool = True
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward_timeout: float = Field(10.0, gt=0, description="Seconds per sample before a reward is failed.")
    failed_reward: float = Field(0.0, description="Score of a sample whose reward raised or timed out.")
    seed: int = Field(0, description="Seeds the task, sampling and initialisation.")


class CheckpointConfig(_Strict):
    every: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at exit).")
    keep: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    progress: bool = Field(True, description="Live progress bar on the terminal.")
    tensorboard: bool = Field(True, description="Write TensorBoard events when tensorboard is installed.")


def _default_rewards() -> list[RewardChoice]:
    return [RewardChoice(name="math_answer", weight=1.0), RewardChoice(name="format", weight=0.2)]


class RunConfig(_Strict):
    """Everything that defines a run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskChoice = Field(default_factory=TaskChoice)
    generator: GeneratorChoice = Field(default_factory=GeneratorChoice)
    trainer: TrainerChoice = Field(default_factory=TrainerChoice)
    transport: TransportChoice = Field(default_factory=TransportChoice)
    scheduler: SchedulerChoice = Field(default_factory=SchedulerChoice)
    rewards: list[RewardChoice] = Field(
        default_factory=_default_rewards, min_length=1, description="Rewards, summed with their weights."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output: str | None = Field(None, description="Run directory (default runs/<timestamp>).")

    @model_validator(mode="before")
    @classmethod
    def _fit_algorithm_to_lengths(cls, data: Any) -> Any:
        """Length-dependent algorithm knobs default to the run's completion length:
        Dr. GRPO's constant normaliser, and DAPO's soft-overlong buffer (a quarter of it;
        the paper's 4096 tokens would not fit under a short max_tokens)."""
        if not isinstance(data, dict) or not isinstance(data.get("algorithm", {}), dict):
            return data
        algo = dict(data.get("algorithm") or {})
        loop = data.get("loop") or {}
        sampling = loop.get("sampling") if isinstance(loop, dict) else None
        max_tokens = sampling.get("max_tokens") if isinstance(sampling, dict) else None
        max_tokens = max_tokens or SamplingConfig.model_fields["max_tokens"].default
        preset = algo.get("preset", "grpo")
        if algo.get("loss_agg", "constant_norm" if preset == "dr_grpo" else None) == "constant_norm":
            algo.setdefault("loss_norm_constant", max_tokens)
        if algo.get("overlong", "soft_penalty" if preset == "dapo" else None) == "soft_penalty":
            algo.setdefault("overlong_buffer", max(1, max_tokens // 4))
        return {**data, "algorithm": algo}

    @model_validator(mode="after")
    def _batch_fits_groups(self) -> "RunConfig":
        if self.algorithm.std_normalize == "group" and self.loop.group_size < 2:
            raise ValueError("loop.group_size must be at least 2 for group-normalised advantages")
        algo = self.algorithm
        if algo.overlong == "soft_penalty" and algo.overlong_buffer >= self.loop.sampling.max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({algo.overlong_buffer}) must be below loop.sampling.max_tokens "
                f"({self.loop.sampling.max_tokens})"
            )
        return self

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)


# ------------------------------------------------------------------------- loading

SINGLE_BACKEND_FIELDS = {
    "generator": "generator",
    "trainer": "trainer",
    "transport": "transport",
    "scheduler": "scheduler",
    "task": "task",
}


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def parse_set(assignments: Iterable[str]) -> list[tuple[list[str], Any]]:
    """``a.b.c=value`` strings → (path, value); values are read as YAML scalars."""
    parsed = []
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key.strip().split("."), value))
    return parsed


def apply_set(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            node = node[_index(node, part, path)]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = path[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else -1
        if idx == len(node):
            node.append(value)
        else:
            node[_index(node, last, path)] = value
    else:
        node[last] = value


def _index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not an index of a list of {len(node)}")
    return int(part)


def build_config(
    file: str | Path | None = None,
    *,
    sets: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Merge defaults < ``base`` < file < ``flags`` < ``sets`` and validate the structure.

    ``flags`` uses the CLI's names: generator, trainer, transport, scheduler, task (backend
    names), rewards (list of names), model, steps, output.
    """
    data: dict[str, Any] = dict(base or {})
    source = "config"
    if file is not None:
        data = _deep_merge(data, read_yaml(file))
        source = str(file)
    data = _deep_copy(data)
    # The CLI default rewards apply only when neither file nor flags name any.
    if not data.get("rewards"):
        data["rewards"] = [r.model_dump() for r in _default_rewards()]
    for key, value in (flags or {}).items():
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        if key in SINGLE_BACKEND_FIELDS:
            section = data.setdefault(key, {})
            if not isinstance(section, dict):
                section = data[key] = {}
            if section.get("name") != value:
                # A different backend does not understand the old one's options.
                section["options"] = {}
            section["name"] = value
        elif key == "rewards":
            data["rewards"] = [{"name": n} for n in value]
        elif key == "model":
            data.setdefault("model", {})["name"] = value
        elif key == "steps":
            data.setdefault("loop", {})["steps"] = value
        elif key == "output":
            data["output"] = value
        else:
            raise ConfigError(f"unknown flag {key!r}")
    # --set comes last so it can refine what a flag selected, e.g.
    # `--reward format --set rewards.0.options.pattern=...`.
    for path, value in parse_set(sets):
        apply_set(data, path, value)
    return validate_config(data, source=source)


def validate_config(data: Mapping[str, Any], *, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc)}") from None


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """All of pydantic's errors on one line: ``loop.steps: must be >= 0 (got -1)``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (remove it, or see `forge config schema`)"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def resolve(config: RunConfig, registry: "Registry", *, check_available: bool = False) -> RunConfig:
    """Check every backend name against the registry and validate every options block
    with the backend's own model; fill in their defaults. ``generator: auto`` becomes the
    fastest available generator. With ``check_available`` a backend that cannot run here
    (missing extra, not built yet) is an error."""
    config = config.model_copy(deep=True)
    if config.generator.name == "auto":
        config.generator.name = "vllm" if "vllm" in registry.available("generator") else "hf"
    choices: list[tuple[str, str, BackendChoice]] = [
        (kind, field, getattr(config, field)) for field, kind in SINGLE_BACKEND_FIELDS.items()
    ]
    choices += [("reward", f"rewards.{i}", r) for i, r in enumerate(config.rewards)]
    for kind, field, choice in choices:
        backend = registry.get(kind, choice.name)
        try:
            options = backend.validate_options(choice.options)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix=f"{field}.options")) from None
        choice.options = options.model_dump(mode="json")
        if check_available and (reason := backend.unavailable_reason()):
            raise BackendUnavailable(f"{kind} {choice.name!r} is unavailable: {reason}")
    _check_model_name(config, registry)
    return config


def _check_model_name(config: RunConfig, registry: "Registry") -> None:
    name = config.model.name
    if name in registry.backends("model"):
        backend = registry.get("model", name)
        try:
            config.model.options = backend.validate_options(config.model.options).model_dump(mode="json")
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix="model.options")) from None
        return
    if config.model.options:
        raise ConfigError(f"model.options is only for named models; {name!r} is not one")


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def config_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()

