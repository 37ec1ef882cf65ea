"""The ``sft`` section of the run config: where a supervised run's demonstrations come
from, how they are rendered and batched, and whether the run evaluates through a
generator. Read only when ``objective: sft``. Imports pydantic, never torch (the CLI
validates configs on machines without it)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from forgerl.configuration.limits import MAX_SAMPLES_PER_STEP, MAX_TOKENS
from forgerl.options import OptionsModel

#: Files one run may train on (a typo in a glob should not open a million files).
MAX_DATA_FILES = 1024


class SFTConfig(OptionsModel):
    """Supervised fine-tuning on demonstrations (docs/sft.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    data: list[str] = Field(
        default_factory=list,
        max_length=MAX_DATA_FILES,
        description="JSONL or Parquet files of demonstrations (rows of messages, prompt + completion, or text), "
        "trained on together in a fresh shuffled order each epoch.",
    )
    task_demonstrations: bool = Field(
        False,
        description="Train on the worked answers of the run's task (a task that gives demonstrations, e.g. "
        "arithmetic), drawn from its training stream; instead of data.",
    )
    format: Literal["auto", "messages", "prompt_completion", "text"] = Field(
        "auto",
        description="The rows' format: auto (each row by its fields: messages, prompt + completion, or text), or "
        "one format for every row (other fields are then ignored).",
    )
    loss_on: Literal["assistant", "all"] = Field(
        "assistant",
        description="assistant: only what the model says (assistant turns, completions) is trained on; prompt, "
        "system, user and tool tokens are context. all: every token (text rows always train on every token).",
    )
    batch_size: int = Field(
        8, ge=1, le=MAX_SAMPLES_PER_STEP, description="Demonstrations per optimiser step (the trainer splits them into "
        "micro-batches by trainer.options.micro_batch_tokens)."
    )
    max_length: int = Field(
        1024, ge=2, le=MAX_TOKENS, description="Most tokens of one rendered demonstration (prompt included)."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="A demonstration longer than max_length: keep its first max_length tokens (truncate) or leave it "
        "out (drop). Either way it is counted in the run's log and summary.",
    )
    shuffle: bool = Field(True, description="Visit the data in a fresh order each epoch (seeded by loop.seed).")
    evaluate: bool = Field(
        False,
        description="Evaluate on the task's held-out problems through the generator (loop.eval_at_start, "
        "loop.eval_every and at the end), as an RL run does; off: the run starts no generator at all.",
    )

    @field_validator("data")
    @classmethod
    def _named_files(cls, paths: list[str]) -> list[str]:
        for i, path in enumerate(paths):
            if not path.strip():
                raise ValueError(f"entry {i} is empty; give a JSONL or Parquet file")
        return paths
