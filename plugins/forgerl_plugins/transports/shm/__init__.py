"""``shm``: versioned safetensors files in shared memory (one machine)."""

from __future__ import annotations

from forgerl.backends import TransportBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="shm",
            factory="forgerl_plugins.transports.shm.transport:ShmTransport",
            options="forgerl_plugins.transports.shm.options:ShmTransportOptions",
            description="safetensors in shared memory, written atomically",
            requires=("torch", "safetensors"),
            preflight="forgerl_plugins.transports.shm.transport:preflight",
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("ShmTransportOptions",))
