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
from typing import TYPE_CHECKING, Any, TypeAlias

from forgerl.errors import ConfigError
from forgerl.teacher import Teacher, TeacherRequest, TeacherScores

from .options import Options as _Options
from .options import teacher_folder

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec

#: Requests in flight at once to a server (each holds up to ``batch_size`` sequences).
SERVED_CONCURRENCY = 4


class ModelTeacher(Teacher):
    name = "model"
    description = "a causal language model scores the student's tokens (in-process, vLLM-served, or at a URL)"
    requires = ("torch", "transformers")

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

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
            # A server taken out of service by an earlier failure (wedged, restarting) is
            # waited for, within the step's distill.timeout, before any chunk is sent to it.
            await self.client.server.wait_in_service()
            limit = asyncio.Semaphore(SERVED_CONCURRENCY)

            async def send(chunk: list[TeacherRequest]) -> list[TeacherScores]:
                async with limit:
                    return await asyncio.to_thread(self.client.score, chunk)

            answers = list(await asyncio.gather(*(send(c) for c in chunks)))
        return [scores for answer in answers for scores in answer]

    def close(self) -> None:
        self.local = self.client = None

