"""The ``sglang`` generator's options (``SGLangGenerator.Options``), in a module of their own
so that the parts the class assembles (:mod:`.engine`, :mod:`.server`) read them without
importing the class."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from forgerl.configuration.config import MAX_SECONDS
from forgerl.options import OptionsModel


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
