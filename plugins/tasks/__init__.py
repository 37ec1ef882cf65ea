"""Built-in tasks: ``arithmetic`` (generated problems) and ``file`` (JSONL/Parquet)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import TaskBackend
from forgerl.hookspecs import hookimpl


class ArithmeticOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_value: int = Field(1, ge=0)
    max_value: int = Field(20, ge=1)
    operations: list[str] = Field(default_factory=lambda: ["+"])
    eval_size: int = Field(64, ge=1)
    tag: str = "answer"


class FileTaskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="JSONL or Parquet file of problems.")
    eval_path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    system_prompt: str | None = None


@hookimpl
def forge_tasks():
    return [
        TaskBackend(
            name="arithmetic",
            factory="forgerl_plugins.tasks.arithmetic:ArithmeticTask",
            options=ArithmeticOptions,
            description="generated integer problems, answer in a tag",
        ),
        TaskBackend(
            name="file",
            factory="forgerl_plugins.tasks.file:FileTask",
            options=FileTaskOptions,
            description="prompts and answers from a JSONL or Parquet file",
        ),
    ]
