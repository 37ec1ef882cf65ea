"""``nccl``: torch.distributed broadcast over private process groups (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return ["forgerl_plugins.transports.nccl.transport:NcclTransport"]
