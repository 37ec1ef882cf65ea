"""Options of the backends registered in forgerl_plugins.tasks (imported only when validated)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from forgerl.options import OptionsModel

ARITHMETIC_OPERATIONS = ("+", "-", "*")


class ArithmeticOptions(OptionsModel):
    min_value: int = Field(1, ge=0, le=10**9, description="Smallest operand.")
    max_value: int = Field(20, ge=1, le=10**9, description="Largest operand (at most 10^9).")
    operations: list[str] = Field(
        default_factory=lambda: ["+"], min_length=1, description="Operations to draw from: +, -, *."
    )
    allow_negative: bool = Field(
        False, description="Allow negative results of '-' (otherwise the larger operand comes first)."
    )
    eval_size: int = Field(
        64, ge=1, le=1_000_000, description="Held-out problems (the same for every run seed), at most 10^6."
    )
    tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]*$", description="The prompt asks for <tag></tag>.")

    @field_validator("operations")
    @classmethod
    def _known_operations(cls, ops: list[str]) -> list[str]:
        unknown = [op for op in ops if op not in ARITHMETIC_OPERATIONS]
        if unknown:
            raise ValueError(f"unknown operations {unknown}; choose from {list(ARITHMETIC_OPERATIONS)}")
        return list(dict.fromkeys(ops))  # drop duplicates, keep order

    @model_validator(mode="after")
    def _range(self) -> ArithmeticOptions:
        if self.min_value > self.max_value:
            raise ValueError(f"min_value ({self.min_value}) must not exceed max_value ({self.max_value})")
        return self


class FileTaskOptions(OptionsModel):
    path: str = Field(
        min_length=1, description="JSONL (one object per line) or Parquet (.parquet) file of problems."
    )
    eval_path: str | None = Field(None, description="Held-out problems; without it, eval_fraction of path.")
    prompt_field: str = Field("prompt", description="Field holding a string or a list of chat messages.")
    answer_field: str | None = Field("answer", description="Field holding the reference; None: no answers.")
    id_field: str = Field("id", description="Field holding a problem id, when present (else file:row).")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of path held out when no eval_path.")
    system_prompt: str | None = Field(None, description="System message put before every prompt.")
    format: str = Field(
        "qa",
        pattern="^(qa|code)$",
        description="qa: prompt and answer; code: prompt and tests for the code reward (docs/rewards.md).",
    )


class CodeBasicsOptions(OptionsModel):
    eval_fraction: float = Field(0.25, ge=0, lt=1, description="Share of the problems held out for eval.")
    system_prompt: str | None = Field(
        "Write the Python function asked for. Answer with the code in one ```python block.",
        description="System message put before every prompt.",
    )
