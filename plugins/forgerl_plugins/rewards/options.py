"""Options of the backends registered in forgerl_plugins.rewards (imported only when validated)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from forgerl.options import OptionsModel


class MathAnswerOptions(OptionsModel):
    tag: str | None = Field(
        "answer",
        pattern=r"^[A-Za-z_][\w-]*$",
        description="Read the answer inside the last <tag></tag>; None: the whole text.",
    )
    fallback_last_number: bool = Field(
        True, description="Without a tagged answer, compare the last number in the text."
    )
    fallback_credit: float = Field(
        0.5, ge=0, le=1, description="Credit for a right answer found only by the fallback."
    )


class FormatOptions(OptionsModel):

    # Non-empty content: "<answer></answer>" alone must not earn the format reward.
    pattern: str = Field(
        r"<answer>\s*[^<\s][^<]*</answer>", description="Regular expression the completion should match."
    )
    mode: str = Field("search", pattern="^(search|fullmatch)$", description="re.search or re.fullmatch.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return pattern
