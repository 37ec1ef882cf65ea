"""`forge report`: plots of one or more runs, as one self-contained HTML file or as PNGs;
``forge eval`` results folders side by side as one table (:mod:`forgerl.report.evals`).

:func:`build_report` is what the command calls. The series plotted come from
:mod:`forgerl.report.data` (plain lists read from metrics.jsonl); the HTML keeps them as
JSON too (``<script id="forge-report-data">``), so the numbers behind every picture can be
read back. matplotlib is imported only when a report is drawn.
"""

from __future__ import annotations

from pathlib import Path

from forgerl.report.data import NotARun, RunData, load_run

__all__ = ["NotARun", "RunData", "build_report", "load_runs"]


def load_runs(run_dirs: list[str], labels: list[str] | None = None) -> list[RunData]:
    from forgerl.errors import UserError

    given: list[str | None] = list(labels or [])
    if len(given) > len(run_dirs):
        raise UserError(f"{len(given)} --label for {len(run_dirs)} run directories: give at most one per run")
    given += [None] * (len(run_dirs) - len(given))
    runs_ = [load_run(d, label) for d, label in zip(run_dirs, given)]
    seen: dict[str, int] = {}
    for run in runs_:  # two runs named alike (a/run, b/run) must still be told apart
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} ({seen[run.label]})"
    return runs_


def default_output(run_dirs: list[str], fmt: str) -> Path:
    """One run: inside its directory. Several: the current directory."""
    base = Path(run_dirs[0]) if len(run_dirs) == 1 else Path(".")
    return base / ("report.html" if fmt == "html" else "report")


def build_report(
    run_dirs: list[str], output: str | Path | None = None, fmt: str = "html", labels: list[str] | None = None
) -> list[Path]:
    """Draw the report of ``run_dirs``; returns the files written (the HTML file, or the
    PNGs in the folder ``output``)."""
    from forgerl.report import evals, render
    from forgerl.report.panels import all_series

    kinds = [evals.is_eval_dir(d) for d in run_dirs]
    if any(kinds):
        from forgerl.errors import UserError

        if not all(kinds):
            raise UserError("give forge eval results folders or training runs, not both: evaluations are a table of "
                            "scores, runs are plots over steps")  # fmt: skip
        if fmt != "html":
            raise UserError("the report of forge eval results is a table: use --format html")
        if len(labels or []) > len(run_dirs):
            raise UserError(f"{len(labels or [])} --label for {len(run_dirs)} directories: give at most one per folder")
        return [evals.write_html(run_dirs, list(labels or []), Path(output) if output else default_output(run_dirs, fmt))]
    runs_ = load_runs(run_dirs, labels)
    out = Path(output) if output else default_output(run_dirs, fmt)
    per_panel = all_series(runs_)
    if fmt == "png":
        return render.write_pngs(runs_, per_panel, out)
    return [render.write_html(runs_, per_panel, out)]
