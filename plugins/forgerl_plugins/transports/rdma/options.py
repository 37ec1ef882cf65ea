"""Options of the backends registered in forgerl_plugins.transports.rdma (imported only when validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from forgerl_plugins.transports.common.options import StoreHostedOptions


class RdmaTransportOptions(StoreHostedOptions):
    """The store-hosted transports' options (host, port, timeouts, ...) and rdma's own."""

    protocol: Literal["rdma", "tcp"] = Field(
        "rdma", description="Mooncake protocol; rdma falls back to TCP by itself where no RDMA NIC exists."
    )
    device_name: str = Field(
        "", description="RDMA NIC(s) to use, e.g. mlx5_0 (empty: Mooncake discovers them)."
    )
    chunk_mb: int = Field(64, ge=1, description="Size of each read request of a batch, in MiB.")
