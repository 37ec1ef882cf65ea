"""Options of the backends registered in forgerl_plugins.transports.nccl (imported only when validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class NcclTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bucket_mb: int = Field(256, ge=1, description="Tensors are moved in chunks of at most this many MiB.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend: auto = nccl where CUDA is available, else gloo."
    )
    host: str = Field(
        "127.0.0.1",
        description="Address of trainer rank 0 as generator workers reach it (its control store and groups).",
    )
    port: int = Field(0, ge=0, le=65535, description="Port of the control store (0: any free port).")
    secret_file: str | None = Field(
        None,
        description="File (mode 0600) holding the secret that signs the control store's messages, for a "
        "sender and receivers started apart on a fixed port (default: <run_dir>/transport.secret, or the "
        "sender's receiver_spec()).",
    )
    timeout: float | None = Field(
        None, gt=0, description="Default seconds for a send or receive (None: the run's transport.timeout)."
    )
    connect_timeout: float = Field(
        30.0, gt=0, description="Seconds to reach the control store or to form a receiver's group."
    )
    stall_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a receiver may go without a chunk completing (or without acknowledging after "
        "its last one) before it is dropped as dead, so that the others go on.",
    )
    poll_interval: float = Field(
        0.02,
        gt=0,
        le=1,
        description="Longest sleep between control-store checks (polls start at 0.5 ms and back off).",
    )
