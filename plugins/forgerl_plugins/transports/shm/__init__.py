"""``shm``: versioned safetensors files in shared memory (one machine)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return ["forgerl_plugins.transports.shm.transport:ShmTransport"]
