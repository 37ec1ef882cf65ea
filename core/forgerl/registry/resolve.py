"""A run config resolved against the installed plugins: every backend name checked, every
options block validated by the backend's own model and kept as that model (its defaults
filled in), ``generator: auto`` made concrete. Every process that builds backends from a
config resolves it first, once (a run's processes: :func:`forgerl.rundirs.runs.load_config`);
building a backend from a resolved config validates nothing again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError

from forgerl.configuration.config import RunConfig, format_validation_error
from forgerl.configuration.kinds import SINGLE_BACKEND_FIELDS
from forgerl.configuration.limits import check_values
from forgerl.configuration.sections import BackendChoice, EnvironmentChoice
from forgerl.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.registry.plugins import Registry


def resolve(config: RunConfig, registry: Registry, *, check_available: bool = False) -> RunConfig:
    """Check every backend name against the registry and validate every options block
    with the backend's own model; fill in their defaults. ``generator: auto`` becomes the
    fastest available generator. Each choice's ``options`` becomes the backend's validated
    options model (a config resolved before passes as it is). With ``check_available`` a
    backend that cannot run here (missing extra, not built yet) is an error."""
    config = config.model_copy(deep=True)
    if config.generator.name == "auto":
        config.generator.name = "vllm" if "vllm" in registry.available("generator") else "hf"
    choices: list[tuple[str, str, BackendChoice | EnvironmentChoice]] = [
        (kind, field, getattr(config, field)) for field, kind in SINGLE_BACKEND_FIELDS.items()
    ]
    choices += [("reward", f"rewards.{i}", r) for i, r in enumerate(config.rewards)]
    if config.environment.name is not None:
        choices.append(("environment", "environment", config.environment))
    if config.objective == "distill":
        choices.append(("teacher", "distill.teacher", config.distill.teacher))
    for kind, field, choice in choices:
        assert choice.name is not None, "an environment without a name is not a choice"
        backend = registry.get(kind, choice.name)
        try:
            options = backend.validate_options(choice.options)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix=f"{field}.options")) from None
        choice.options = options
        if check_available and (reason := backend.unavailable_reason()):
            raise BackendUnavailable(f"{kind} {choice.name!r} is unavailable: {reason}")
    _check_model_name(config, registry)
    _check_overlap(config)
    check_values(config.model_dump(mode="python"))
    return config


def _check_model_name(config: RunConfig, registry: Registry) -> None:
    name = config.model.name
    if name in registry.backends("model"):
        backend = registry.get("model", name)
        try:
            config.model.options = backend.validate_options(config.model.options)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix="model.options")) from None
        return
    if config.model.options:
        raise ConfigError(f"model.options is only for named models; {name!r} is not one")


def _check_overlap(config: RunConfig) -> None:
    """``loop.overlap: continuous`` updates the generator while its requests are in flight:
    only a generator whose update policy keeps them (``keep``: vllm, sglang) can."""
    if config.loop.overlap != "continuous":
        return
    name, options = config.generator.name, config.generator.options
    policy = getattr(options, "update_policy", None)
    if policy == "keep":
        return
    said = "loop.overlap continuous updates weights with requests in flight"
    if policy is not None and _accepts_keep(options):
        raise ConfigError(
            f"{said}, which update_policy {policy!r} does not: set generator.options.update_policy=keep, "
            "or loop.overlap=versioned"
        )
    raise ConfigError(
        f"{said}, which generator {name!r} cannot (it has no update_policy keep): use --generator vllm "
        "or sglang with generator.options.update_policy=keep, or set loop.overlap=versioned"
    )


def _accepts_keep(options: object) -> bool:
    if not isinstance(options, BaseModel):
        return False
    try:
        type(options).model_validate({**options.model_dump(), "update_policy": "keep"})
    except ValidationError:
        return False
    return True


def rewards_unused(config: RunConfig, registry: Registry) -> str | None:
    """Why the config's ``rewards`` score nothing in this run (None: they are used): its
    environment scores every trajectory itself (``scores = True``), so the rewards, the
    defaults included, are never called."""
    name = config.environment.name
    if name is None or config.environment.sources is not None:
        return None  # no environment, or one that plays some sources: the others' rewards score
    if scores_itself(registry.get("environment", name).load_factory()):
        return f"environment {name!r} scores its trajectories itself (scores = True)"
    return None


def scores_itself(factory: object) -> bool:
    """Whether an environment backend's factory is a class that gives the reward itself
    (``scores = True``), so the run's Reward plugins never see its trajectories."""
    from forgerl.environment import Environment

    return isinstance(factory, type) and issubclass(factory, Environment) and factory.scores is True
