"""The run configuration.

One :class:`RunConfig` describes a run. Each backend choice names the backend and carries
its options block, which the backend's own options model validates (unknown keys
refused, ranges checked) in :func:`resolve`. Precedence: defaults < YAML file < named
flags (``--generator``, ``--steps``, ...) < ``--set`` values (applied last, so they can
refine what a flag selected).

This module is the one to import from; it gathers three that it is built from: the
sections (:mod:`forgerl.config_sections`), where values come from (YAML and ``--set``,
:mod:`forgerl.config_sources`) and the bounds on sizes (:mod:`forgerl.config_limits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from forgerl.config_limits import (
    INT64_MAX,
    MAX_GROUP_SIZE,
    MAX_PROMPTS_PER_STEP,
    MAX_RANKS,
    MAX_REWARDS,
    MAX_SAMPLES_PER_STEP,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    check_values,
)
from forgerl.config_sections import (
    DEFAULT_MODEL,
    BackendChoice,
    CheckpointConfig,
    GeneratorChoice,
    LoggingConfig,
    LoopConfig,
    ModelConfig,
    RewardChoice,
    RunConfig,
    SamplingConfig,
    SchedulerChoice,
    TaskChoice,
    TrainerChoice,
    TransportChoice,
    default_rewards,
)
from forgerl.config_sources import (
    MAX_CONFIG_BYTES,
    apply_set,
    deep_copy,
    deep_merge,
    parse_set,
    read_yaml,
    writable_section,
)
from forgerl.errors import BackendUnavailable, ConfigError
from forgerl.kinds import FLAGS, SINGLE_BACKEND_FIELDS

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.plugins import Registry

__all__ = [
    "DEFAULT_MODEL",
    "INT64_MAX",
    "MAX_CONFIG_BYTES",
    "MAX_GROUP_SIZE",
    "MAX_PROMPTS_PER_STEP",
    "MAX_RANKS",
    "MAX_REWARDS",
    "MAX_SAMPLES_PER_STEP",
    "MAX_SECONDS",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TOKENS",
    "SINGLE_BACKEND_FIELDS",
    "BackendChoice",
    "CheckpointConfig",
    "GeneratorChoice",
    "LoggingConfig",
    "LoopConfig",
    "ModelConfig",
    "RewardChoice",
    "RunConfig",
    "SamplingConfig",
    "SchedulerChoice",
    "TaskChoice",
    "TrainerChoice",
    "TransportChoice",
    "apply_set",
    "build_config",
    "config_schema",
    "format_validation_error",
    "parse_set",
    "read_yaml",
    "resolve",
    "validate_config",
]

def build_config(
    file: str | Path | None = None,
    *,
    sets: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Merge defaults < ``base`` < file < ``flags`` < ``sets`` and validate the structure.

    ``flags`` uses the CLI's names (:data:`forgerl.kinds.FLAGS`): generator, trainer,
    transport, scheduler, task (backend names), rewards (list of names), model, steps,
    output; any other key is a ConfigError that lists them.
    """
    data: dict[str, Any] = dict(base or {})
    source = "config"
    if file is not None:
        data = deep_merge(data, read_yaml(file))
        source = str(file)
    data = deep_copy(data)
    # The CLI default rewards apply only when neither file nor flags name any.
    if data.get("rewards") is None:
        data["rewards"] = [r.model_dump() for r in default_rewards()]
    flags = dict(flags or {})
    _refuse_unknown_flags(flags)
    for key, value in flags.items():
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        if key in SINGLE_BACKEND_FIELDS:
            section = writable_section(data, key, source)
            if section.get("name") != value:
                # A different backend does not understand the old one's options.
                section["options"] = {}
            section["name"] = value
        elif key == "rewards":
            data["rewards"] = [{"name": n} for n in value]
        elif key == "model":
            writable_section(data, "model", source)["name"] = value
        elif key == "steps":
            writable_section(data, "loop", source)["steps"] = value
        elif key == "output":
            data["output"] = value
    # --set comes last so it can refine what a flag selected, e.g.
    # `--reward format --set rewards.0.options.pattern=...`.
    for path, value in parse_set(sets):
        apply_set(data, path, value)
    return validate_config(data, source=source)


def _refuse_unknown_flags(flags: Mapping[Any, Any]) -> None:
    """A key that is not a flag would otherwise be dropped silently (an embedding program's
    ``"reward"`` for ``"rewards"``): name it and every key that is accepted, on one line."""
    unknown = [key for key in flags if key not in FLAGS]
    if unknown:
        raise ConfigError(
            f"unknown flag {unknown[0]!r}: flags accepts {', '.join(FLAGS)} "
            "(any other key goes through sets, e.g. 'loop.group_size=8')"
        )


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
    check_values(config.model_dump(mode="python"))
    return config


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


def config_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()

