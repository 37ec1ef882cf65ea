"""The ``sglang`` generator: SGLang servers (started by the scheduler), used over HTTP.

Trainer rank 0 builds :class:`SGLangGenerator`: the pool of replicas shared with the other
server generators (:mod:`..common.pool`: dispatch to the least busy ready replica,
failover to the others, the watcher that re-syncs a restarted replica before it takes
traffic, the update policy) built with SGLang's engine adapter (:mod:`.engine`: native
``/generate`` per sample, weight loads through an engine receiver of the run's transport:
``files`` → ``/update_weights_from_disk``, ``broadcast`` →
``/update_weights_from_distributed``). Here: its identity, options, server roles, and
which of the transport's engine receivers it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from forgerl.configuration.config import MAX_SECONDS
from forgerl.errors import ConfigError, UserError
from forgerl.interfaces import RunContext, Transport
from forgerl.options import OptionsModel
from forgerl_plugins.generators.common.pool import ReplicaPool

from . import SGLANG_VERSION, adapter, server
from .engine import SGLangEngine

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

    class Options(OptionsModel):
        replicas: int = Field(
            1, ge=1, le=4096, description="SGLang server processes; requests are balanced across them."
        )
        tensor_parallel_size: int = Field(
            1, ge=1, le=1024, description="Tensor-parallel GPUs per replica (--tp-size)."
        )
        dtype: str = Field(
            "auto",
            pattern="^(auto|float32|bfloat16|float16)$",
            description="Serving dtype (auto: model.dtype of the run, so sampler and trainer agree).",
        )
        mem_fraction_static: float | None = Field(
            None, gt=0, lt=1, description="GPU memory fraction for weights and KV cache (default: SGLang's)."
        )
        context_length: int | None = Field(
            None, ge=1, le=2**24, description="Context length (default: the model's)."
        )
        max_concurrency: int = Field(
            64, ge=1, le=1 << 20, description="HTTP requests in flight across all replicas."
        )
        update_policy: str = Field(
            "wait",
            pattern="^(wait|abort|keep)$",
            description="In-flight requests at a weight update: wait (drain, then pause in place), abort "
            "(pause mode abort; they are resubmitted whole), or keep (pause mode retract: they go on with the "
            "new weights, prefilled again, never resubmitted; their completions carry per-token versions from "
            "SGLang's weight_versions, and a sample's staleness counts from its oldest token).",
        )
        weight_sync: str = Field(
            "auto",
            pattern="^(auto|files|broadcast)$",
            description="How servers take new weights: files (/update_weights_from_disk on a folder the transport "
            "stages: shm), broadcast (/update_weights_from_distributed in a group with the trainer: nccl), "
            "auto: what the run's transport offers.",
        )
        send_seed: bool = Field(
            False,
            description="Send sampling_seed per sample. SGLang honours it only with --sampling-backend pytorch "
            "(server_args: {sampling_backend: pytorch}); flashinfer refuses seeded requests.",
        )
        startup_timeout: float = Field(
            600.0, gt=0, le=MAX_SECONDS, description="Seconds to wait for a replica to become healthy."
        )
        request_timeout: float = Field(
            600.0, gt=0, le=MAX_SECONDS, description="Seconds one generation request may take."
        )
        health_interval: float = Field(
            2.0, gt=0, le=3600, description="Seconds between health checks of each replica."
        )
        liveness_timeout: float = Field(
            60.0,
            gt=0,
            le=MAX_SECONDS,
            description="Seconds a running server's engine may go without answering its launcher's probe "
            "(tokens made since the last probe, or a one-token request) before the launcher kills it as hung; "
            "it is then restarted and re-synced like a crashed one. A weight load does not count.",
        )
        max_restarts: int = Field(
            3, ge=0, le=1000, description="Times the scheduler restarts a replica that dies."
        )
        host: str = Field("127.0.0.1", description="Address the servers bind to (loopback by default).")
        env: dict[str, str] = Field(
            default_factory=dict, description="Extra environment of the server processes."
        )
        server_args: dict[str, Any] = Field(
            default_factory=dict,
            description="More SGLang server arguments, e.g. {chunked_prefill_size: 4096} becomes "
            "--chunked-prefill-size 4096 (true: the bare flag; false or null: left out).",
        )
        launch_command: list[str] | None = Field(
            None,
            min_length=1,
            description="The Python and program that serve one replica, before its arguments (default: this Python's "
            "`-m sglang.launch_server`), e.g. another environment's Python; run as PYTHON -m "
            "forgerl_plugins.generators.sglang.guard PROGRAM (every endpoint behind the run's key), so forgerl "
            "must be importable there.",
        )

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
