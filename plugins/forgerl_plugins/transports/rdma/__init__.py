"""``rdma``: one-sided reads over RDMA verbs (Mooncake TransferEngine), TCP fallback."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return ["forgerl_plugins.transports.rdma.transport:RdmaTransport"]
