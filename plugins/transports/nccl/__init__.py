"""``nccl``: torch.distributed broadcast over a private group (gloo on CPU)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import TransportBackend
from forgerl.hookspecs import hookimpl


class NcclTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bucket_mb: int = Field(256, ge=1)


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="nccl",
            factory=None,
            options=NcclTransportOptions,
            description="broadcast from trainer rank 0 over a private process group",
            requires=("torch",),
            implemented=False,
        )
    ]
