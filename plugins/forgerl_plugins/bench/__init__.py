"""``forge bench``: measurements of forgerl's parts against the raw paths they are built on.

A first-party plugin that adds commands through the ``forge_commands`` hook; nothing heavy
is imported until a command runs.

    forge bench transport nccl --bytes 500MB [--receivers 2] [--json]
"""

from __future__ import annotations

from typing import Any

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_commands(cli: Any) -> None:
    import click

    group = cli.commands.get("bench")
    if group is None:

        @cli.group("bench")
        def group() -> None:
            """Measure forgerl's parts against the raw paths they are built on."""

    @group.command("transport")
    @click.argument("name")
    @click.option(
        "--bytes",
        "size",
        default="500MB",
        show_default=True,
        help="Size of the synthetic weight set: 500MB, 1GB, 64MiB, 8000000.",
    )
    @click.option(
        "--receivers",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Receiver processes (generator workers).",
    )
    @click.option(
        "--rounds",
        type=click.IntRange(min=1),
        default=5,
        show_default=True,
        help="Timed versions per path (after one warm-up version).",
    )
    @click.option(
        "--option",
        "options",
        multiple=True,
        metavar="KEY=VALUE",
        help="A transport option (repeatable), e.g. bucket_mb=64.",
    )
    @click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds per transfer.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    def transport(
        name: str,
        size: str,
        receivers: int,
        rounds: int,
        options: tuple[str, ...],
        timeout: float,
        as_json: bool,
    ) -> None:
        """Move a synthetic weight set through transport NAME into receiver processes, and
        through the raw path it is built on; print GB/s of both and their ratio."""
        import json

        from forgerl_plugins.bench.transport import format_report, parse_options, parse_size, run

        result = run(
            name,
            parse_size(size),
            receivers=receivers,
            rounds=rounds,
            options=parse_options(options),
            timeout=timeout,
        )
        click.echo(json.dumps(result, indent=2) if as_json else format_report(result))
