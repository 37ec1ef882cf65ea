"""``delta``: per version, only the bytes that changed against the receiver's base, over one
authenticated TCP port (docs/transports.md)."""

from __future__ import annotations

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return ["forgerl_plugins.transports.delta.transport:DeltaTransport"]
