"""What every ``forge`` subcommand shares: the plugin registry, built once per command,
whether tracebacks are shown, and the one-line error."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.registry.plugins import Registry


class State:
    debug = False
    registry: Registry | None = None


def registry() -> Registry:
    """The plugin registry, built once per command (plugins load once, hooks trace once)."""
    if State.registry is None:
        from forgerl.registry.plugins import build_registry

        State.registry = build_registry(collect=False)  # backends are collected when a command needs them
    return State.registry


def fail(message: str) -> None:
    # One line, whatever the message holds: a user error is never spread over lines.
    click.echo(f"forge: error: {' '.join(str(message).split())}", err=True)
