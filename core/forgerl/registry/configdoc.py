"""docs/config.md, generated from the pydantic models (``forge config schema --markdown``).

A test regenerates it and fails when the committed file differs, so the reference never
drifts from the code.
"""

from __future__ import annotations

import re
import typing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.registry.plugins import Registry

HEADER = """# Config reference

Generated from the pydantic models by `forge config schema --markdown`; do not edit by
hand. Precedence: defaults < YAML file < named flags < `--set key=value`. Unknown keys are
refused everywhere.

"""


def _type_name(annotation: Any) -> str:
    from forgerl.configuration.sections import BackendOptions

    if annotation == typing.get_args(BackendOptions)[0]:
        return "dict[str, Any]"  # as written; a resolved config holds the backend's options model
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    # A class inside a generic prints with its module (list[forgerl.configuration.sections.RewardChoice]):
    # the reference names it as a reader knows it, not by the module that defines it.
    text = re.sub(r"\b(?:[a-z_]\w*\.)+(?=[A-Z])", "", text)
    return text.replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    else:
        return "(required)"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump() for v in value]
    return f"`{value!r}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _rows(ann, f"{key}.")
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {_type_name(ann).replace('|', chr(92) + '|')} | {_default(field)} | {desc} |")
    return rows


def _table(model: type[BaseModel], prefix: str = "") -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    return "\n".join(lines + _rows(model, prefix)) + "\n"


def render_markdown(registry: Registry | None = None, *, third_party: bool = True) -> str:
    """The config reference; with a registry, every backend's options too: forgerl's own,
    then (``third_party``) those of the third-party plugins installed here."""
    from forgerl.configuration.config import RewardChoice, RunConfig

    parts = [HEADER, "## The run\n\n", _table(RunConfig), "\nEach entry of `rewards`:\n", _table(RewardChoice)]
    if registry is not None:
        parts.append("\n## Backend options\n\nThe `options` block of each backend choice.\n")
        for kind in registry.kinds:
            for name, backend in sorted(registry.backends(kind).items()):
                info = registry.owner(kind, name)
                if not info.first_party:
                    continue  # listed below, under their distribution
                model = backend.options_model
                if not model.model_fields:
                    continue
                state = "" if backend.implemented else " (not implemented yet)"
                parts.append(f"\n### {kind} `{name}`{state}\n\n{_table(model)}")
        others = [item for item in _backend_options(registry, first_party=False) if item[3].model_fields]
        if third_party and others:
            parts.append(
                "\n## Options of installed third-party backends\n\n"
                "Provided by plugins installed here, not by forgerl (`forge plugins list`).\n"
            )
            for info, kind, backend, model in others:
                where = f"{info.distribution} {info.version}".strip()
                parts.append(f"\n### {kind} `{backend.name}` ({where})\n\n{_table(model)}")
    return "".join(parts)


def json_schema(registry: Registry | None = None, *, third_party: bool = True) -> dict[str, Any]:
    """The JSON schema of the run config. With a registry, each backend choice also checks
    its ``options`` against the options model of the backend it names (``if`` the name is
    X ``then`` the options are X's), for forgerl's backends and (``third_party``) those of
    installed plugins: editors then complete and check every options block."""
    from pydantic.json_schema import models_json_schema

    from forgerl.configuration.config import (
        SINGLE_BACKEND_FIELDS,
        EnvironmentChoice,
        ModelConfig,
        RewardChoice,
        RunConfig,
    )

    if registry is None:
        return RunConfig.model_json_schema()
    choice_kinds: dict[Any, str] = {
        RunConfig.model_fields[field].annotation: kind for field, kind in SINGLE_BACKEND_FIELDS.items()
    }
    choice_kinds[RewardChoice] = "reward"
    choice_kinds[ModelConfig] = "model"
    choice_kinds[EnvironmentChoice] = "environment"
    backends = [
        item for item in _backend_options(registry, first_party=True if not third_party else None)
        if registry.clash(item[1], item[2].name) is None or item[0].first_party
    ]
    models = list(dict.fromkeys([RunConfig, *choice_kinds, *(model for *_, model in backends)]))
    refs, top = models_json_schema([(m, "validation") for m in models], ref_template="#/$defs/{model}")
    defs = top["$defs"]

    def ref(model: Any) -> str:
        return refs[(model, "validation")]["$ref"]

    schema = defs.pop(ref(RunConfig).rsplit("/", 1)[-1])
    for choice, kind in choice_kinds.items():
        conditions = [
            {
                "if": {"properties": {"name": {"const": backend.name}}, "required": ["name"]},
                "then": {
                    "properties": {"options": {"$ref": ref(model), "description": _whose(kind, backend, info)}}
                },
            }
            for info, k, backend, model in backends
            if k == kind
        ]
        if conditions:
            defs[ref(choice).rsplit("/", 1)[-1]]["allOf"] = conditions
    schema["$defs"] = defs
    return schema


def _whose(kind: str, backend: Any, info: Any) -> str:
    where = "" if info.first_party else f" ({info.distribution} {info.version})".replace(" )", ")")
    return f"Options of {kind} `{backend.name}`{where}. {backend.description}".strip()


def _backend_options(
    registry: Registry, *, first_party: bool | None
) -> list[tuple[Any, str, Any, type[BaseModel]]]:
    """(plugin, kind, backend, options model) of every loaded plugin's backends, forgerl's
    or not (``first_party``; None: both). A third-party options model that cannot be
    imported or turned into a schema is left out with a warning: one broken plugin must
    not take the whole reference with it."""
    from forgerl.errors import BackendLoadError
    from forgerl.registry.plugin_problems import warn

    found = []
    for info in sorted(registry.plugins.values(), key=lambda i: (not i.first_party, i.name)):
        if info.status != "loaded" or (first_party is not None and info.first_party != first_party):
            continue
        for backend in sorted(info.backends, key=lambda b: (registry.kinds.index(b.kind), b.name)):
            if info.first_party:
                found.append((info, backend.kind, backend, backend.options_model))
                continue
            try:
                model = backend.options_model
                if not (isinstance(model, type) and issubclass(model, BaseModel)):
                    raise TypeError(f"its options are {model!r}, not a pydantic model")
                model.model_json_schema()
            except (BackendLoadError, TypeError, ValueError) as exc:
                warn(f"left out the options of {backend.kind} {backend.name!r} of {info.label}: {exc}")
                continue
            found.append((info, backend.kind, backend, model))
    return found
