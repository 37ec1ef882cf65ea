"""``shm``: versioned safetensors files in shared memory (one machine)."""

from __future__ import annotations

from forgerl.backends import TransportBackend
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
        )
    ]


def __getattr__(name: str):
    # The options models live in .options so that listing backends never imports pydantic.
    if name == "ShmTransportOptions":
        from . import options

        return getattr(options, name)
    raise AttributeError(name)
