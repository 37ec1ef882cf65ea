"""The options the store-hosted transports (``nccl``, ``rdma``) share, declared once:
where the control store listens, how its messages are signed, and how long to wait.
The base of ``NcclTransport.Options`` and ``RdmaTransport.Options``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StoreHostedOptions(BaseModel):
    """Base of a store-hosted transport's options model; each transport adds its own."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        "127.0.0.1",
        description="Address of trainer rank 0 as generator workers reach it: its control store, and the "
        "transport's data path (nccl: its process groups; rdma: its transfer engine).",
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
        30.0, gt=0, description="Seconds to reach the control store (nccl: also to form a receiver's group)."
    )
    poll_interval: float = Field(
        0.02,
        gt=0,
        le=1,
        description="Longest sleep between control-store checks (polls start at 0.5 ms and back off).",
    )
