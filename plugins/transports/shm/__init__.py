"""``shm``: versioned safetensors files in shared memory (one machine)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgerl.backends import TransportBackend
from forgerl.hookspecs import hookimpl


class ShmTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    directory: str | None = Field(
        None, description="Where versions are written (default: /dev/shm when large enough, else a temp dir)."
    )
    keep_versions: int = Field(2, ge=1, description="Versions kept on disk; older ones are removed.")
    poll_interval: float = Field(0.05, gt=0, description="Seconds between checks while a receiver waits.")


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="shm",
            factory="forgerl_plugins.transports.shm.transport:ShmTransport",
            options=ShmTransportOptions,
            description="safetensors in shared memory, written atomically",
            requires=("torch", "safetensors"),
        )
    ]
