"""``forge config show|schema|validate``: the resolved run config, its schema, a file checked."""

from __future__ import annotations

import json
from typing import Any

import click

from forgerl.commands.launching import config_options, flags
from forgerl.commands.session import registry


@click.group("config")
def config_group() -> None:
    """Show, validate and describe run configurations."""


@config_group.command("show")
@config_options
def config_show(config_file: str | None, sets: tuple[str, ...], **kwargs: Any) -> None:
    """Print the resolved config (defaults < file < flags < --set), backend options filled in."""
    from forgerl import api
    from forgerl.registry.resolve import rewards_unused

    plugin_registry = registry()
    config = api.load_config(config_file, sets=sets, flags=flags(kwargs), registry=plugin_registry)
    text = config.to_yaml()
    unused = rewards_unused(config, plugin_registry)
    if unused is not None:
        # A YAML comment: the output still loads as the same config.
        text = text.replace("\nrewards:\n", f"\n# rewards: not used in this run: {unused}\nrewards:\n", 1)
    click.echo(text, nl=False)


@config_group.command("schema")
@click.option("--markdown", is_flag=True, help="The config reference (docs/config.md) instead.")
@click.option(
    "--builtin-only", is_flag=True, help="Leave out the options of third-party backends (as docs/config.md)."
)
def config_schema(markdown: bool, builtin_only: bool) -> None:
    """Print the JSON schema of the run config, every installed backend's options included."""
    from forgerl.registry import configdoc

    if markdown:
        click.echo(configdoc.render_markdown(registry(), third_party=not builtin_only), nl=False)
        return
    click.echo(json.dumps(configdoc.json_schema(registry(), third_party=not builtin_only), indent=2))


@config_group.command("validate")
@click.argument("config_file", type=click.Path(dir_okay=False))
def config_validate(config_file: str) -> None:
    """Check a config file: structure, backend names and every backend's options."""
    from forgerl import api

    api.load_config(config_file, registry=registry())
    click.echo(f"{config_file}: ok")
