"""docs/config.md, generated from the pydantic models (``forge config schema --markdown``).

A test regenerates it and fails when the committed file differs, so the reference never
drifts from the code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.plugins import Registry

HEADER = """# Config reference

Generated from the pydantic models by `forge config schema --markdown`; do not edit by
hand. Precedence: defaults < YAML file < named flags < `--set key=value`. Unknown keys are
refused everywhere.

"""


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


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


def render_markdown(registry: "Registry | None" = None) -> str:
    from forgerl.config import RewardChoice, RunConfig

    parts = [HEADER, "## The run\n\n", _table(RunConfig), "\nEach entry of `rewards`:\n", _table(RewardChoice)]
    if registry is not None:
        parts.append("\n## Backend options\n\nThe `options` block of each backend choice.\n")
        for kind in registry.kinds:
            for name, backend in sorted(registry.backends(kind).items()):
                info = registry.owner(kind, name)
                if info.distribution != "forgerl":
                    continue  # third-party plugins document their own options
                model = backend.options_model
                if not model.model_fields:
                    continue
                state = "" if backend.implemented else " (not implemented yet)"
                parts.append(f"\n### {kind} `{name}`{state}\n\n{_table(model)}")
    return "".join(parts)
