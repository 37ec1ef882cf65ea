"""``forge plugins list``: every plugin, its backends and whether each can run here."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from forgerl.commands.session import registry
from forgerl.configuration.kinds import REGISTRATION_HOOKS

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.backends import Backend
    from forgerl.registry.plugin_info import PluginInfo
    from forgerl.registry.plugins import Registry


@click.group()
def plugins() -> None:
    """Installed plugins and their backends."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_list(as_json: bool) -> None:
    """Every plugin: distribution, version, hooks, backends and whether each can run here."""
    plugin_registry = registry()
    rows: list[dict[str, Any]] = []
    for info in sorted(plugin_registry.listing().values(), key=lambda i: (not i.first_party, i.name, i.distribution)):
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "status": info.status,
                "error": info.error,
                "hooks": info.hooks,
                "backends": [_backend_row(plugin_registry, info, b) for b in info.backends],
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        head = f"{row['name']}  ({row['distribution']} {row['version']})"
        if row["status"] != "loaded":
            head += f"  [{row['status']}{': ' + row['error'] if row['error'] else ''}]"
        click.echo(head)
        for b in row["backends"]:
            mark = "ok " if b["available"] else "-- "
            why = "" if b["available"] else f"  (unavailable: {b['reason']})"
            click.echo(f"  {mark}{b['kind']:<11} {b['name']:<22} {b['description']}{why}")
        other = [h for h in row["hooks"] if h not in REGISTRATION_HOOKS.values()]
        if other:
            click.echo(f"     hooks: {', '.join(other)}")


def _backend_row(registry: Registry, info: PluginInfo, backend: Backend) -> dict[str, Any]:
    """One backend of one plugin; a name another plugin claims too cannot be used."""
    clash = registry.clash(backend.kind, backend.name)
    reason = clash.reason_for(info) if clash is not None else backend.unavailable_reason()
    return {
        "kind": backend.kind,
        "name": backend.name,
        "description": backend.description,
        "available": reason is None,
        "reason": reason,
        "clash": clash.message() if clash is not None else None,
    }
