"""The ``sglang`` generator: SGLang servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`SGLangGenerator`: the pool of replicas shared with the other
server generators (:mod:`..common.pool`: dispatch to the least busy ready replica,
failover to the others, the watcher that re-syncs a restarted replica before it takes
traffic, the update policy) built with SGLang's engine adapter (:mod:`.engine`: native
``/generate`` per sample, weight loads through an engine receiver of the run's transport:
``files`` → ``/update_weights_from_disk``, ``broadcast`` →
``/update_weights_from_distributed``). Here: its identity, options
(defined in :mod:`.options`, which the parts import), server roles, and which of the
transport's engine receivers it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, TypeAlias

from forgerl.errors import ConfigError, UserError
from forgerl.interfaces import RunContext, Transport
from forgerl_plugins.generators.common.pool import ReplicaPool

from . import SGLANG_VERSION, adapter, server
from .engine import SGLangEngine
from .options import Options as _Options

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.types import RoleSpec

#: Preferred first when the transport offers both.
SYNC_KINDS = ("broadcast", "files")


def choose_weight_sync(wanted: str, transport: Transport) -> str:
    """``files`` or ``broadcast``: what the options ask for and the transport offers."""
    offered = tuple(getattr(transport, "engine_receivers", ()))
    name = type(transport).__name__
    if wanted == "auto":
        for kind in SYNC_KINDS:
            if kind in offered:
                return kind
        raise UserError(
            f"the sglang generator needs a transport SGLang can load from (shm or nccl); {name} offers "
            "neither files nor broadcast"
        )
    if wanted not in offered:
        raise UserError(
            f"generator.options.weight_sync is {wanted!r}, but the run's transport ({name}) offers "
            f"{list(offered) or 'nothing an engine can load'}: use shm for files, nccl for broadcast"
        )
    return wanted


class SGLangGenerator(ReplicaPool):
    """``SGLangGenerator(options, *, context, transport)``: connects to the replicas of
    ``context.run_dir`` and loads new weights into them through ``transport``'s engine
    receivers."""

    name = "sglang"
    description = "SGLang servers (replicas, weight updates, failover; GPU only)"
    requires = ("sglang",)
    extra = "sglang"
    # SGLang has no CPU build: say so before anyone installs 11 GB for nothing.
    install_hint = f"pip install 'forgerl[sglang]' (SGLang {SGLANG_VERSION}; CUDA GPUs only)"
    info: ClassVar[dict[str, str]] = {"install": f"pip install 'forgerl[sglang]' (SGLang {SGLANG_VERSION}; CUDA GPUs only)"}
    #: With a LoRA trainer, the servers start with LoRA on and each version's adapter is
    #: loaded from the folder the transport stages, under one name (:mod:`.adapter`).
    serves_adapters: ClassVar[bool] = True

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    @staticmethod
    def roles(options: SGLangGenerator.Options, *, context: RunContext) -> list[RoleSpec]:
        """The replicas' launchers the scheduler starts (:func:`.server.roles`)."""
        return server.roles(options, context=context)

    @staticmethod
    def serve(options: SGLangGenerator.Options, *, context: RunContext, role: str, replica: int) -> int:
        """One replica of the role, in the process forgerl.server_role starts (:func:`.server.serve`)."""
        return server.serve(options, context=context, role=role, replica=replica)

    def __init__(self, options: SGLangGenerator.Options, *, context: RunContext, transport: Transport) -> None:
        weight_sync = choose_weight_sync(options.weight_sync, transport)  # before any server is asked
        if context.adapter is not None:
            if options.update_policy == "keep":
                # Version 0 is the base model here (no adapter loaded, requests name none):
                # a request started on it would go on without the adapter after the update.
                raise ConfigError(
                    "generator.options.update_policy keep does not work with a LoRA adapter "
                    "(trainer.options.lora) on the sglang generator yet: use wait or abort"
                )
            adapter.module_kinds(context.adapter)  # ConfigError: no module SGLang serves LoRA on
            if weight_sync != "files":
                raise ConfigError(
                    "the sglang generator loads a LoRA adapter (trainer.options.lora) from a folder the "
                    f"transport stages; SGLang {SGLANG_VERSION} cannot receive one by broadcast: "
                    "use --transport shm"
                )
        engine = SGLangEngine(options, weight_sync, context=context, transport=transport)
        super().__init__(engine, options, context=context)
