"""Shared option models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class NoOptions(BaseModel):
    """Options model of a backend that takes none."""

    model_config = ConfigDict(extra="forbid")
