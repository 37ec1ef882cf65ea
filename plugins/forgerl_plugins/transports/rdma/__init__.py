"""``rdma``: one-sided reads over RDMA verbs (Mooncake TransferEngine), TCP fallback."""

from __future__ import annotations

from forgerl.backends import TransportBackend, lazy_options
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return [
        TransportBackend(
            name="rdma",
            factory="forgerl_plugins.transports.rdma.transport:RdmaTransport",
            options="forgerl_plugins.transports.rdma.options:RdmaTransportOptions",
            description="one-sided RDMA reads with a TCP fallback (Mooncake)",
            requires=("mooncake",),
            extra="rdma",
        )
    ]


# Options models live in .options, imported on first use (listing backends never imports pydantic).
__getattr__ = lazy_options(__name__, ("RdmaTransportOptions",))
