"""The ``reward_model`` reward's options (``RewardModelReward.Options``), in a module of their
own so that the parts the class assembles (:mod:`.reward_model_client`, :mod:`.reward_server`)
read them without importing the class."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from forgerl.options import OptionsModel


class Options(OptionsModel):
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
    request_timeout: float = Field(
        60.0, gt=0, le=3600, description="Seconds one scoring request may take."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024, description="GPUs of the run's server (server: vllm)."
    )
    startup_timeout: float = Field(
        600.0, gt=0, le=86400, description="Seconds the trainer waits for the run's server to be ready."
    )
    max_restarts: int = Field(
        3, ge=0, le=1000, description="Times the scheduler restarts the run's server."
    )
    host: str = Field("127.0.0.1", description="Address the run's server binds to (loopback by default).")
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        le=1 << 20,
        description="KV cache of the run's server, GiB (default: 0.25 on CPU, vLLM's on GPU).",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment of the run's server."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More vLLM engine arguments for the run's server ({max_num_seqs: 64}).",
    )

    @model_validator(mode="after")
    def _one_server(self) -> Options:
        if self.url is not None and self.server != "none":
            raise ValueError(
                "give either url (a server already running) or server: vllm (the run starts one)"
            )
        if self.auth_env is not None and self.url is None:
            raise ValueError("auth_env is the key of the server at url: give url too")
        return self
