"""``forge report``: plots of runs (and evaluations), overlaid, as one HTML page or PNGs."""

from __future__ import annotations

import click


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--output", "-o", type=click.Path(), help="File to write (default RUN_DIR/report.html for one run, "
              "./report.html for several); with --format png, a folder, or NAME.png for the overview alone.")
@click.option("--format", "fmt", type=click.Choice(["html", "png"]), default="html", show_default=True,
              help="One self-contained HTML page, or one PNG per plot.")
@click.option("--label", "labels", multiple=True, help="Name of each run in the plots, in order (default: "
              "the directory's name).")
def report(run_dirs: tuple[str, ...], output: str | None, fmt: str, labels: tuple[str, ...]) -> None:
    """Plot runs (finished, failed or still going): reward, accuracy, lengths, staleness,
    logprob gap, entropy, grad norm and time per step, against step and wall time; several
    runs are overlaid, with a table of their config differences."""
    from forgerl.report import build_report

    for path in build_report(list(run_dirs), output, fmt, list(labels)):
        click.echo(str(path))
