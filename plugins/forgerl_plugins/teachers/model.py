"""The ``model`` teacher: a causal language model scores the student's sampled tokens.

Configured like the served ``reward_model`` reward: ``model`` names the teacher (a named
model such as ``smollm2-135m-instruct`` or ``tiny``, a Hugging Face folder, or anything
else ``model.name`` accepts), and it scores

* in the trainer's process (default): a transformers forward pass over a batch of
  sequences, on a worker thread (:mod:`.local`);
* through a vLLM server the run starts beside the trainer (``server: vllm``): prompt
  logprobs of the token ids through ``/v1/completions`` (:mod:`.client`, :mod:`.server`),
  behind the run's key, restarted by the scheduler like any replica;
* through any OpenAI-compatible server at ``url`` that returns ``prompt_logprobs`` for
  token-id prompts (vLLM's does); ``model`` still names its tokenizer, for the check that
  it is the student's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from forgerl.distill.teacher import Teacher, TeacherRequest, TeacherScores
from forgerl.errors import ConfigError
from forgerl.options import OptionsModel

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec

#: Requests in flight at once to a server (each holds up to ``batch_size`` sequences).
SERVED_CONCURRENCY = 4


class ModelTeacher(Teacher):
    name = "model"
    description = "a causal language model scores the student's tokens (in-process, vLLM-served, or at a URL)"
    requires = ("torch", "transformers")

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
        def _one_server(self) -> ModelTeacher.Options:
            if self.url is not None and self.server != "none":
                raise ValueError("give either url (a server already running) or server: vllm (the run starts one)")
            if self.auth_env is not None and self.url is None:
                raise ValueError("auth_env is the key of the server at url: give url too")
            if self.served_model is not None and self.url is None:
                raise ValueError("served_model names the model of the server at url: give url too")
            return self

    # ------------------------------------------------------------- before and beside the run

    @staticmethod
    def roles(options: ModelTeacher.Options, *, context: RunContext) -> list[RoleSpec]:
        """One vLLM server when ``server: vllm`` (:mod:`.server`); none otherwise."""
        from .server import roles

        return roles(options, context=context)

    @staticmethod
    def serve(options: ModelTeacher.Options, *, context: RunContext, role: str, replica: int) -> int:
        """The server of ``role``, in the process forgerl.server_role starts (:func:`.server.serve`)."""
        from .server import serve

        return serve(options, context=context, role=role, replica=replica)

    @staticmethod
    def tokenizer_folder(options: ModelTeacher.Options) -> Path:
        """The teacher's model folder (built first for a named model), whose tokenizer
        ``forge run`` compares with the student's before launch."""
        return teacher_folder(options)

    @staticmethod
    def local_preflight(options: ModelTeacher.Options) -> None:
        """The API key of a server at ``url`` is in the environment (as the reward model's)."""
        import os

        if options.url is not None and options.auth_env and not os.environ.get(options.auth_env):
            raise ConfigError(
                f"distill.teacher: the environment variable {options.auth_env!r} (options.auth_env) is not set or "
                "empty; export it with the API key of the server at url before `forge run`"
            )

    # ------------------------------------------------------------------------- scoring

    def __init__(self, options: Options, *, context: RunContext) -> None:
        self.options = options
        self.local: Any = None
        self.client: Any = None
        if options.server != "none" or options.url is not None:
            from .client import ServedTeacher

            self.client = ServedTeacher(options)  # the run's server: waits until it is ready
        else:
            from .local import LocalTeacher

            self.local = LocalTeacher(teacher_folder(options), device=options.device, dtype=options.dtype)

    async def ascore(self, requests: Sequence[TeacherRequest]) -> list[TeacherScores]:
        size = self.options.batch_size
        chunks = [list(requests[i : i + size]) for i in range(0, len(requests), size)]
        if self.local is not None:
            # One model: one forward pass at a time, each on a worker thread.
            answers = [await asyncio.to_thread(self.local.score, chunk) for chunk in chunks]
        else:
            limit = asyncio.Semaphore(SERVED_CONCURRENCY)

            async def send(chunk: list[TeacherRequest]) -> list[TeacherScores]:
                async with limit:
                    return await asyncio.to_thread(self.client.score, chunk)

            answers = list(await asyncio.gather(*(send(c) for c in chunks)))
        return [scores for answer in answers for scores in answer]

    def close(self) -> None:
        self.local = self.client = None


def teacher_folder(options: ModelTeacher.Options) -> Path:
    """The local Hugging Face folder of ``options.model``, resolved as ``model.name`` is
    (:func:`forgerl.models.resolve_model`: a named model is built on first use)."""
    from forgerl.config import ModelConfig
    from forgerl.models import resolve_model
    from forgerl.plugins import build_registry

    registry = build_registry()
    if options.model_options and options.model not in registry.backends("model"):
        raise ConfigError(
            f"distill.teacher.options.model_options is only for named models; {options.model!r} is not one"
        )
    return resolve_model(ModelConfig(name=options.model, options=options.model_options), registry)
