"""Options of the backends registered in forgerl_plugins.rewards (imported only when validated)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

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


class CodeOptions(OptionsModel):
    value: str = Field(
        "pass_rate",
        pattern="^(pass_rate|all_passed)$",
        description="The reward: share of tests passed, or 1 if all.",
    )
    code_from: str = Field(
        "fenced_or_raw",
        pattern="^(fenced|raw|fenced_or_raw)$",
        description="The program: the first python code block, the whole text, or the block else the text.",
    )
    isolation: str = Field(
        "auto",
        pattern="^(auto|namespace|bwrap|process)$",
        description="Sandbox level; an explicit level that this machine lacks stops the run at start.",
    )
    timeout: float = Field(5.0, gt=0, le=600, description="Wall-clock seconds per program run.")
    cpu_seconds: int | None = Field(None, ge=1, le=600, description="CPU seconds per run (default: timeout).")
    memory_mb: int = Field(1024, ge=64, le=1 << 20, description="Address space per run, MiB.")
    processes: int = Field(32, ge=1, le=4096, description="Processes the program may have (RLIMIT_NPROC).")
    file_size_mb: int = Field(16, ge=1, le=1 << 20, description="Largest file the program may write, MiB.")
    open_files: int = Field(64, ge=16, le=65536, description="Open file descriptors per run.")
    max_output_kb: int = Field(64, ge=1, le=1 << 20, description="Stdout/stderr read back per run, KiB.")
    concurrency: int | None = Field(
        None, ge=1, le=1024, description="Programs at once on this machine (default: the usable cores)."
    )
    python: str | None = Field(None, description="Interpreter for the programs (default: this one).")
    workdir: str | None = Field(None, description="Where the per-run directories go (default: the temp dir).")


class RemoteOptions(OptionsModel):
    url: str = Field(pattern=r"^https?://", description="Where to POST each sample (http:// or https://).")
    timeout: float = Field(10.0, gt=0, le=3600, description="Seconds per request.")
    retries: int = Field(2, ge=0, le=20, description="Retries after a connection error, timeout, 429 or 5xx.")
    backoff: float = Field(
        0.5, ge=0, le=60, description="Seconds before the first retry, doubled for each next."
    )
    concurrency: int = Field(16, ge=1, le=4096, description="Requests in flight at once (per process).")
    auth_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the auth token (the token is never in the config).",
    )
    auth_header: str = Field("Authorization", min_length=1, description="Header the token goes in.")
    auth_scheme: str = Field("Bearer", description="Put before the token ('' for none).")
    score_field: str = Field("score", description="Field of the answer holding the score.")
    components_field: str = Field("components", description="Field of the answer holding named components.")
    max_response_bytes: int = Field(1 << 20, ge=64, description="Largest answer read.")


class RewardModelOptions(OptionsModel):
    model: str = Field(min_length=1, description="Folder (or hub id) of a sequence-classification model.")
    label: int | None = Field(
        None,
        ge=0,
        description="Which label's probability is the score (default: the last; 1-label models: the logit).",
    )
    activation: str = Field(
        "auto",
        pattern="^(auto|none|sigmoid|softmax)$",
        description="auto: the raw logit for 1 label, softmax otherwise; sigmoid squashes a 1-label logit.",
    )
    chat_template: bool = Field(
        True, description="Render prompt and completion with the tokenizer's chat template."
    )
    batch_size: int = Field(16, ge=1, le=4096, description="Samples per forward pass.")
    max_length: int = Field(4096, ge=8, description="Tokens per sample; longer ones keep their end.")
    device: str | None = Field(None, description="torch device (default: cuda when available, else cpu).")
    dtype: str | None = Field(
        None, pattern="^(float32|bfloat16|float16)$", description="Weights' dtype (default: as saved)."
    )
    # Served scoring: a vLLM pooling server (the run's own, or one at ``url``).
    server: str = Field(
        "none",
        pattern="^(none|vllm)$",
        description="none: score in the trainer's process (transformers); vllm: the run starts a vLLM "
        "pooling server for the model beside the trainer and scores through its /classify endpoint.",
    )
    url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Score through a vLLM pooling server already running there (its /classify endpoint) "
        "instead; `model` still names its tokenizer and config.",
    )
    auth_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the API key of the server at `url`.",
    )
    request_timeout: float = Field(60.0, gt=0, le=3600, description="Seconds one scoring request may take.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024, description="GPUs of the run's server (server: vllm)."
    )
    startup_timeout: float = Field(
        600.0, gt=0, le=86400, description="Seconds the trainer waits for the run's server to be ready."
    )
    max_restarts: int = Field(3, ge=0, le=1000, description="Times the scheduler restarts the run's server.")
    host: str = Field("127.0.0.1", description="Address the run's server binds to (loopback by default).")
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        le=1 << 20,
        description="KV cache of the run's server, GiB (default: 0.25 on CPU, vLLM's on GPU).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the run's server.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More vLLM engine arguments for the run's server ({max_num_seqs: 64}).",
    )

    @model_validator(mode="after")
    def _one_server(self) -> RewardModelOptions:
        if self.url is not None and self.server != "none":
            raise ValueError(
                "give either url (a server already running) or server: vllm (the run starts one)"
            )
        if self.auth_env is not None and self.url is None:
            raise ValueError("auth_env is the key of the server at url: give url too")
        return self
