"""The ``model`` teacher's options (``ModelTeacher.Options``), in a module of their own so
that the parts the class assembles (:mod:`.local`, :mod:`.client`, :mod:`.server`) read them
without importing the class; and :func:`teacher_folder`, the teacher's model as a local
folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from forgerl.errors import ConfigError
from forgerl.options import OptionsModel


class Options(OptionsModel):
    model: str = Field(
        min_length=1,
        description="The teacher: a named model (`forge plugins list`), a Hugging Face folder, or any other "
        "name model.name accepts. With url, the model whose tokenizer the server uses.",
    )
    model_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of a named teacher model (as model.options for the student)."
    )
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per forward pass, or per server request.")
    device: str | None = Field(None, description="torch device in-process (default: cuda when available, else cpu).")
    dtype: str | None = Field(
        None, pattern="^(float32|bfloat16|float16)$", description="Weights' dtype (default: as saved)."
    )
    server: str = Field(
        "none",
        pattern="^(none|vllm)$",
        description="none: score in the trainer's process (transformers); vllm: the run starts a vLLM server "
        "for the teacher beside the trainer and scores through its /v1/completions prompt logprobs.",
    )
    url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Score through an OpenAI-compatible server already running there (its API root, e.g. "
        "http://host:8000/v1), which must return prompt_logprobs for token-id prompts (vLLM does).",
    )
    served_model: str | None = Field(
        None, min_length=1, description="The model name to ask the server at url for (default: the server's own)."
    )
    auth_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the API key of the server at `url`.",
    )
    request_timeout: float = Field(120.0, gt=0, le=3600, description="Seconds one scoring request may take.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="GPUs of the run's server (server: vllm).")
    startup_timeout: float = Field(
        600.0, gt=0, le=86400, description="Seconds the trainer waits for the run's server to be ready."
    )
    max_restarts: int = Field(3, ge=0, le=1000, description="Times the scheduler restarts the run's server.")
    host: str = Field("127.0.0.1", description="Address the run's server binds to (loopback by default).")
    kv_cache_gb: float | None = Field(
        None, gt=0, le=1 << 20, description="KV cache of the run's server, GiB (default: 0.5 on CPU, vLLM's on GPU)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the run's server.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More vLLM engine arguments for the run's server ({max_num_seqs: 64}).",
    )

    @model_validator(mode="after")
    def _one_server(self) -> Options:
        if self.url is not None and self.server != "none":
            raise ValueError("give either url (a server already running) or server: vllm (the run starts one)")
        if self.auth_env is not None and self.url is None:
            raise ValueError("auth_env is the key of the server at url: give url too")
        if self.served_model is not None and self.url is None:
            raise ValueError("served_model names the model of the server at url: give url too")
        return self


def teacher_folder(options: Options) -> Path:
    """The local Hugging Face folder of ``options.model``, resolved as ``model.name`` is
    (:func:`forgerl.models.resolve.resolve_model`: a named model is built on first use)."""
    from forgerl.configuration.config import ModelConfig
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry

    registry = build_registry()
    if options.model_options and options.model not in registry.backends("model"):
        raise ConfigError(
            f"distill.teacher.options.model_options is only for named models; {options.model!r} is not one"
        )
    return resolve_model(ModelConfig(name=options.model, options=options.model_options), registry)
