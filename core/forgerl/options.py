"""Shared option models.

:class:`OptionsModel` is the base of the run config's sections and of every first-party
backend's options: unknown keys are refused, floats must be finite (a NaN weight or an
infinite learning rate would otherwise pass validation and fail deep inside a trainer),
and a YAML boolean is not accepted where a number is expected (pydantic's lax mode would
read ``steps: true`` as 1).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_NUMBERS = (int, float)


def _is_number_annotation(annotation: Any) -> bool:
    if annotation in _NUMBERS:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in _NUMBERS for a in args)
    return False


class OptionsModel(BaseModel):
    """Base of options models: ``extra="forbid"``, finite floats, no booleans for numbers."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _is_number_annotation(field.annotation):
                raise ValueError(f"expected a number, got the boolean {value}")
        return value


class NoOptions(OptionsModel):
    """Options model of a backend that takes none."""
