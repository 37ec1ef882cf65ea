"""``nccl``: torch.distributed broadcast over private process groups (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

from forgerl.backends import TransportBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="nccl",
            factory="forgerl_plugins.transports.nccl.transport:NcclTransport",
            options="forgerl_plugins.transports.nccl.options:NcclTransportOptions",
            description="broadcast from trainer rank 0 over private process groups (gloo on CPU)",
            requires=("torch",),
            local_preflight="forgerl_plugins.transports.nccl.groups:local_preflight",
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("NcclTransportOptions",))
