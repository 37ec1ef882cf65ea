"""The run configuration.

One :class:`RunConfig` describes a run. Each backend choice names the backend and carries
its options block, which the backend's own options model validates (unknown keys
refused, ranges checked) in :func:`resolve`. Precedence: defaults < YAML file < named
flags (``--generator``, ``--steps``, ...) < ``--set`` values (applied last, so they can
refine what a flag selected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from forgerl.algorithms.config import PRESETS, AlgorithmConfig, fill_length_defaults
from forgerl.capped_read import read_capped
from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.options import OptionsModel

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.plugins import Registry

DEFAULT_MODEL = "smollm2-135m-instruct"

# Upper bounds on sizes. They are far above any run these machines (or a cluster) can
# place, and low enough that a typo such as `group_size: 1e12` is refused at validation
# instead of allocating gigabytes or launching thousands of processes.
MAX_STEPS = 10_000_000
MAX_PROMPTS_PER_STEP = 65_536
MAX_GROUP_SIZE = 1_024
MAX_SAMPLES_PER_STEP = 1_048_576
MAX_TOKENS = 1_048_576
MAX_RANKS = 65_536
MAX_REWARDS = 64
MAX_SECONDS = 7 * 24 * 3600
# numpy's legacy seeding takes 32-bit seeds; torch takes 64-bit ones.
MAX_SEED = 2**32 - 1
# Every integer in a config must fit a signed 64-bit integer (torch, numpy, C).
INT64_MAX = 2**63 - 1


class _Strict(OptionsModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class BackendChoice(_Strict):
    """A backend selected by name, with its options block (validated by the backend)."""

    name: str = Field(description="Backend name, as listed by `forge plugins list`.")
    options: dict[str, Any] = Field(default_factory=dict, description="The backend's own options.")


class GeneratorChoice(BackendChoice):
    name: str = Field("auto", description="Generator backend; `auto` picks vllm when installed, else hf.")


class TrainerChoice(BackendChoice):
    name: str = Field("fsdp", description="Trainer backend.")
    ranks: int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description=f"Trainer processes (torch.distributed ranks), at most {MAX_RANKS}; the scheduler "
        "also refuses more than it can place (local: the cores this machine lets forge use).",
    )


class TransportChoice(BackendChoice):
    name: str = Field("shm", description="Weight transport from trainer to generators.")
    timeout: float = Field(
        120.0, gt=0, le=MAX_SECONDS, description="Seconds a weight transfer may take before it fails (at most a week)."
    )


class SchedulerChoice(BackendChoice):
    name: str = Field("local", description="Where the run's processes run.")


class TaskChoice(BackendChoice):
    name: str = Field("arithmetic", description="Source of prompts and reference answers.")


class RewardChoice(BackendChoice):
    weight: float = Field(
        1.0, ge=-1e6, le=1e6, description="Weight of this reward in the total (a weighted sum); finite, |weight| <= 1e6."
    )


class ModelConfig(_Strict):
    name: str = Field(
        DEFAULT_MODEL,
        description="A named model (`forge plugins list` shows them: tiny, smollm2-135m-instruct), "
        "a local Hugging Face folder, or a hub id where the network allows.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of a named model source.")


class SamplingConfig(_Strict):
    max_tokens: int = Field(
        64,
        ge=1,
        le=MAX_TOKENS,
        description=f"Most tokens per completion (at most {MAX_TOKENS}, and no more than the model's "
        "context length, checked before a run starts).",
    )
    temperature: float = Field(1.0, ge=0, le=100, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=1_000_000, description="-1 disables top-k.")


class LoopConfig(_Strict):
    steps: int = Field(
        20, ge=0, le=MAX_STEPS, description=f"Training steps (optimiser updates) in the run, at most {MAX_STEPS}."
    )
    prompts_per_step: int = Field(
        8,
        ge=1,
        le=MAX_PROMPTS_PER_STEP,
        description=f"Prompt groups per training batch, at most {MAX_PROMPTS_PER_STEP}; prompts_per_step x "
        f"group_size at most {MAX_SAMPLES_PER_STEP}.",
    )
    group_size: int = Field(
        4, ge=1, le=MAX_GROUP_SIZE, description=f"Completions sampled per prompt (GRPO group), at most {MAX_GROUP_SIZE}."
    )
    max_staleness: int = Field(
        0, ge=0, description="Oldest policy version lag a sample may have when trained on; 0 = on-policy."
    )
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="Evaluate every N steps (0: only at start and end).")
    eval_size: int | None = Field(
        None, ge=1, le=MAX_SAMPLES_PER_STEP, description="Evaluate on the first N held-out problems."
    )
    eval_temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature for evaluation (0 greedy).")
    eval_at_start: bool = True
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward_timeout: float = Field(
        10.0, gt=0, le=MAX_SECONDS, description="Seconds per sample before a reward is failed (at most a week)."
    )
    failed_reward: float = Field(
        0.0, ge=-1e6, le=1e6, description="Score of a sample whose reward raised or timed out."
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description=f"Seeds the task, sampling and initialisation (0 to {MAX_SEED})."
    )

    @model_validator(mode="after")
    def _batch_is_placeable(self) -> LoopConfig:
        samples = self.prompts_per_step * self.group_size
        if samples > MAX_SAMPLES_PER_STEP:
            raise ValueError(
                f"prompts_per_step x group_size = {self.prompts_per_step} x {self.group_size} = {samples} "
                f"completions per step; at most {MAX_SAMPLES_PER_STEP}"
            )
        return self


class CheckpointConfig(_Strict):
    every: int = Field(10, ge=0, le=MAX_STEPS, description="Checkpoint every N steps (0: only at exit).")
    keep: int = Field(2, ge=1, le=1000, description="Checkpoints kept; older ones are deleted.")


class WandbConfig(_Strict):
    enabled: bool = Field(False, description="Send each step's metrics to Weights & Biases (needs `wandb`).")
    project: str = Field("forgerl", min_length=1, description="The W&B project.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: write <run_dir>/wandb, no network (upload later with `wandb sync`); "
        "online: upload as the run goes (after `wandb login`).",
    )


class MlflowConfig(_Strict):
    enabled: bool = Field(False, description="Send each step's metrics to MLflow (needs `mlflow` or `mlflow-skinny`).")
    tracking_uri: str | None = Field(
        None, description="An MLflow tracking URI (a server, sqlite:///...); default a file store in <run_dir>/mlruns."
    )
    experiment: str = Field("forgerl", min_length=1, description="The MLflow experiment.")


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    progress: bool = Field(
        True,
        description="Progress on stderr from the start: a step bar in a terminal, one line per event and "
        "step otherwise (`forge run --quiet` turns it off).",
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard events to <run_dir>/tensorboard (skipped, with a note, without tensorboard)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


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
        default_factory=_default_rewards,
        min_length=1,
        max_length=MAX_REWARDS,
        description="Rewards, summed with their weights.",
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output: str | None = Field(None, description="Run directory (default runs/<timestamp>); not empty.")

    @field_validator("output")
    @classmethod
    def _output_names_a_place(cls, value: str | None) -> str | None:
        # An empty --output would silently mean "the default place".
        if value is not None and not value.strip():
            raise ValueError("must name a directory, not be empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _fit_algorithm_to_lengths(cls, data: Any) -> Any:
        """Length-dependent algorithm knobs that neither the user nor the preset sets
        default to the run's completion length (see ``fill_length_defaults``)."""
        if not isinstance(data, dict) or not isinstance(data.get("algorithm", {}), dict):
            return data
        loop = data.get("loop") or {}
        sampling = loop.get("sampling") if isinstance(loop, dict) else None
        max_tokens = sampling.get("max_tokens") if isinstance(sampling, dict) else None
        if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS:
            # A bad max_tokens is reported by its own field; derive from the default meanwhile.
            max_tokens = SamplingConfig.model_fields["max_tokens"].default
        return {**data, "algorithm": fill_length_defaults(dict(data.get("algorithm") or {}), max_tokens)}

    @model_validator(mode="after")
    def _batch_fits_groups(self) -> RunConfig:
        if self.algorithm.std_normalize == "group" and self.loop.group_size < 2:
            raise ValueError("loop.group_size must be at least 2 for group-normalised advantages")
        algo = self.algorithm
        max_tokens = self.loop.sampling.max_tokens
        if algo.overlong == "soft_penalty" and algo.overlong_buffer >= max_tokens:
            # Most often the dapo preset's 4096-token ramp (DAPO sampled 20480 tokens)
            # under a short max_tokens: say where the value came from and both fixes.
            from_preset = (
                f", the {algo.preset} preset's"
                if algo.overlong_buffer == PRESETS[algo.preset]["overlong_buffer"]
                else ""
            )
            raise ValueError(
                f"algorithm.overlong_buffer ({algo.overlong_buffer}{from_preset}) must be below "
                f"loop.sampling.max_tokens ({max_tokens}): set algorithm.overlong_buffer "
                f"(e.g. {max(1, max_tokens // 4)}, a quarter of max_tokens) or raise loop.sampling.max_tokens"
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


#: A config larger than this is not a config (a model file or a log given by mistake).
MAX_CONFIG_BYTES = 16 * 1024 * 1024


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML silently
    keeps the last one, so a duplicated section would hide half of what the user wrote)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it
                break
            line = key_node.start_mark.line + 1
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key]} and {line})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file; ConfigError (one line) for anything else."""
    path = Path(path)
    try:
        # At most one byte past the limit: /dev/zero or a huge file must not fill memory.
        raw = read_capped(path, MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"cannot read config file {str(path)!r}: {reason}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a config is a YAML file"
        ) from None
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: not valid YAML ({' '.join(str(problem).split())})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {_describe(data)}")
    return data


def parse_set(assignments: Iterable[str]) -> list[tuple[list[str], Any]]:
    """``a.b.c=value`` strings → (path, value); values are read as YAML scalars."""
    parsed = []
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        path = key.strip().split(".")
        if any(not part.strip() for part in path):
            raise ConfigError(f"--set {item!r}: {key.strip()!r} has an empty part; expected dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except (yaml.YAMLError, RecursionError):
            value = raw
        parsed.append((path, value))
    return parsed


def apply_set(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            node = node[_index(node, part, path)]
        else:
            if part not in node or node[part] is None:
                node[part] = [] if nxt.isdigit() else {}
            node = node[part]
        if not isinstance(node, (dict, list)):
            where = ".".join(path[: i + 1])
            raise ConfigError(
                f"--set {'.'.join(path)}: {where} is {_describe(node)}, not a section with keys"
            )
    last = path[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else -1
        if idx == len(node):
            node.append(value)
        else:
            node[_index(node, last, path)] = value
    else:
        node[last] = value


def _section(data: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """``data[key]`` as a mapping a flag can write into (created when absent)."""
    if key not in data:
        data[key] = {}
    section = data[key]
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {key}: must be a mapping of keys, not {_describe(section)}")
    return section


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if data.get("rewards") is None:
        data["rewards"] = [r.model_dump() for r in _default_rewards()]
    for key, value in (flags or {}).items():
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        if key in SINGLE_BACKEND_FIELDS:
            section = _section(data, key, source)
            if section.get("name") != value:
                # A different backend does not understand the old one's options.
                section["options"] = {}
            section["name"] = value
        elif key == "rewards":
            data["rewards"] = [{"name": n} for n in value]
        elif key == "model":
            _section(data, "model", source)["name"] = value
        elif key == "steps":
            _section(data, "loop", source)["steps"] = value
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
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (remove it, or see `forge config schema`)"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            got = repr(err["input"])
            if got not in msg:
                msg = f"{msg} (got {got if len(got) <= 80 else got[:77] + '...'})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def resolve(config: RunConfig, registry: Registry, *, check_available: bool = False) -> RunConfig:
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
    _check_values(config.model_dump(mode="python"))
    return config


def _check_values(data: Any) -> None:
    """Every value of a resolved config, backend options included (a third-party options
    model may not refuse them itself): floats finite, integers within int64, strings
    without NUL bytes (no path or command can hold one)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: a deeply nested options block must not overflow the stack
        where, value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number (got {value})")
        elif _is_int(value) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ConfigError(f"{where}: {value} does not fit a 64-bit integer")
        elif isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{where}: must not contain a NUL byte (got {value[:60]!r})")


def _check_model_name(config: RunConfig, registry: Registry) -> None:
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

