"""Options of the backends registered in forgerl_plugins.transports.rdma (imported only when validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RdmaTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol: Literal["rdma", "tcp"] = Field(
        "rdma", description="Mooncake protocol; rdma falls back to TCP by itself where no RDMA NIC exists."
    )
    device_name: str = Field(
        "", description="RDMA NIC(s) to use, e.g. mlx5_0 (empty: Mooncake discovers them)."
    )
    chunk_mb: int = Field(64, ge=1, description="Size of each read request of a batch, in MiB.")
    host: str = Field(
        "127.0.0.1",
        description="Address of trainer rank 0 as generator workers reach it (engine and control store).",
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
    connect_timeout: float = Field(30.0, gt=0, description="Seconds to reach the control store.")
    poll_interval: float = Field(
        0.02,
        gt=0,
        le=1,
        description="Longest sleep between control-store checks (polls start at 0.5 ms and back off).",
    )
