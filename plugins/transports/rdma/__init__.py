"""``rdma``: one-sided reads over RDMA verbs (Mooncake TransferEngine), TCP fallback."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from forgerl.backends import TransportBackend
from forgerl.hookspecs import hookimpl


class RdmaTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="rdma",
            factory=None,
            options=RdmaTransportOptions,
            description="one-sided RDMA reads with a TCP fallback (Mooncake)",
            requires=("mooncake",),
            extra="rdma",
            implemented=False,
        )
    ]
