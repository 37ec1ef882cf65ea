"""``forge fleet``: generator servers that several runs share, each with its own LoRA adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from forgerl.commands.session import registry


@click.command()
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The fleet's directory (its servers' endpoints and logs); runs attach to it.")
@click.option("--model", required=True, help="The base model, as a run's model.name names it.")
@click.option("--generator", default="vllm", show_default=True, help="Generator backend whose servers serve the fleet.")
@click.option("--max-adapters", type=click.IntRange(min=1, max=256), default=4, show_default=True,
              help="Adapters a server holds at once.")
@click.option("--max-rank", type=click.IntRange(min=1, max=512), default=16, show_default=True,
              help="The largest adapter rank a run may train.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="generator.options.* (and model.*) settings.")
def fleet(directory: Path, model: str, generator: str, max_adapters: int, max_rank: int, sets: tuple[str, ...]) -> None:
    """Start generator servers that several runs share, each training its own LoRA adapter
    (runs attach with --set generator.options.fleet=DIR). Serves until Ctrl-C or SIGTERM."""
    from forgerl.fleet import serve_fleet

    code = serve_fleet(registry(), generator, directory, model=model, max_adapters=max_adapters,
                       max_rank=max_rank, sets=sets, say=click.echo,
                       fail=lambda line: click.echo(line, err=True))  # fmt: skip
    if code:
        sys.exit(code)
