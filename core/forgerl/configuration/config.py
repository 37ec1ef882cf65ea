"""The run configuration.

One :class:`RunConfig` describes a run. Each backend choice names the backend and carries
its options block, which the backend's own options model validates (unknown keys
refused, ranges checked) in :func:`resolve`. Precedence: defaults < YAML file < named
flags (``--generator``, ``--steps``, ...) < ``--set`` values (applied last, so they can
refine what a flag selected).

This module is the one to import from; it gathers three that it is built from: the
sections (:mod:`forgerl.configuration.sections`), where values come from (YAML and ``--set``,
:mod:`forgerl.configuration.sources`) and the bounds on sizes (:mod:`forgerl.configuration.limits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from forgerl.configuration.kinds import FLAGS, SINGLE_BACKEND_FIELDS
from forgerl.configuration.limits import (
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
)
from forgerl.configuration.sections import (
    DEFAULT_MODEL,
    BackendChoice,
    CheckpointConfig,
    DistillConfig,
    EnvironmentChoice,
    GeneratorChoice,
    LoggingConfig,
    LoopConfig,
    ModelConfig,
    RewardChoice,
    RunConfig,
    SamplingConfig,
    SchedulerChoice,
    TaskChoice,
    TeacherChoice,
    TrainerChoice,
    TransportChoice,
    default_rewards,
)
from forgerl.configuration.sources import (
    MAX_CONFIG_BYTES,
    apply_set,
    deep_copy,
    deep_merge,
    parse_set,
    read_yaml,
    writable_section,
)
from forgerl.errors import ConfigError

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
    "DistillConfig",
    "EnvironmentChoice",
    "GeneratorChoice",
    "LoggingConfig",
    "LoopConfig",
    "ModelConfig",
    "RewardChoice",
    "RunConfig",
    "SamplingConfig",
    "SchedulerChoice",
    "TaskChoice",
    "TeacherChoice",
    "TrainerChoice",
    "TransportChoice",
    "apply_set",
    "build_config",
    "config_schema",
    "format_validation_error",
    "parse_set",
    "read_yaml",
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

    ``flags`` uses the CLI's names (:data:`forgerl.configuration.kinds.FLAGS`): generator, trainer,
    transport, scheduler, task (backend names), rewards (list of names), model, steps,
    output, environment; any other key is a ConfigError that lists them.
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
        elif key == "environment":
            section = writable_section(data, "environment", source)
            if section.get("name") != value:
                section["options"] = {}
            section["name"] = value
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


def config_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()

