"""Writing a report: one self-contained HTML page (PNG images inlined as base64, the
series as JSON), or one PNG per panel."""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from forgerl.errors import UserError
from forgerl.report.data import RunData, Series, config_differences, default_config
from forgerl.report.panels import PANELS, draw, figure_png, overview
from forgerl.report.samples import CSS as SAMPLES_CSS
from forgerl.report.samples import section as samples_section

DATA_ID = "forge-report-data"


def series_data(runs_: list[RunData], per_panel: dict[str, list[list[Series]]]) -> dict[str, Any]:
    """What the pictures show, as JSON: per run, per panel, per metric, the points."""
    out: dict[str, Any] = {"runs": []}
    for i, run in enumerate(runs_):
        panels = {
            pid: {s.key: {"step": s.steps, "wall_s": s.walls, "value": s.values} for s in per_run[i]}
            for pid, per_run in per_panel.items()
        }
        out["runs"].append(
            {"label": run.label, "run_dir": str(run.run_dir), "status": run.status,
             "eval_accuracy_start": (run.summary or {}).get("eval_accuracy_start"), "panels": panels}
        )
    return out


def _ensure_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {str(path.parent)!r}: {exc.strerror}") from None


def _write(path: Path, data: bytes | str) -> None:
    try:
        if isinstance(data, str):
            path.write_text(data, encoding="utf-8")
        else:
            path.write_bytes(data)
    except OSError as exc:
        raise UserError(f"cannot write {str(path)!r}: {exc.strerror}") from None


def write_pngs(runs_: list[RunData], per_panel: dict[str, list[list[Series]]], folder: Path) -> list[Path]:
    """Every plot into ``folder``; an output named ``*.png`` gets the overview alone (a
    picture for a README or a chat)."""
    if folder.suffix.lower() == ".png" and not folder.is_dir():
        _ensure_parent(folder)
        _write(folder, figure_png(overview(runs_, per_panel), dpi=110))
        return [folder]
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output {str(folder)!r} is a file: with --format png, give a folder for the images "
                        "(or a name ending in .png for the overview alone)")
    _ensure_parent(folder / "overview.png")
    overview_path = folder / "overview.png"
    _write(overview_path, figure_png(overview(runs_, per_panel), dpi=110))
    written = [overview_path]
    for panel in PANELS:
        if panel.id not in per_panel:
            continue
        path = folder / f"{panel.id}.png"
        _ensure_parent(path)
        _write(path, figure_png(draw(panel, runs_, per_panel[panel.id]), dpi=110))
        written.append(path)
    return written


def write_html(runs_: list[RunData], per_panel: dict[str, list[list[Series]]], path: Path) -> Path:
    if path.is_dir():
        raise UserError(f"--output {str(path)!r} is a folder: give a file name such as report.html")
    _ensure_parent(path)
    _write(path, page(runs_, per_panel))
    return path


def page(runs_: list[RunData], per_panel: dict[str, list[list[Series]]]) -> str:
    e = html.escape
    title = "forge report: " + ", ".join(r.label for r in runs_)
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
        f"<style>{_CSS}{SAMPLES_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
        f'<p class="muted">made {e(time.strftime("%Y-%m-%d %H:%M:%S"))} by <code>forge report</code></p>',
        _runs_table(runs_), _config_table(runs_),
    ]
    missing = [p.title for p in PANELS if p.id not in per_panel]
    png = figure_png(overview(runs_, per_panel))
    parts.append(f'<section id="overview"><img alt="overview" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                 "</section>")
    for panel in PANELS:
        if panel.id not in per_panel:
            continue
        png = figure_png(draw(panel, runs_, per_panel[panel.id]))
        parts.append(f'<section id="{panel.id}"><h2>{e(panel.title)}</h2>')
        if panel.note:
            parts.append(f'<p class="muted">{e(panel.note)}</p>')
        parts.append(f'<img alt="{e(panel.title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">')
        parts.append("</section>")
    if missing:
        parts.append(f'<p class="muted">No data in these runs for: {e(", ".join(missing))}.</p>')
    parts.append(samples_section(runs_))
    data = json.dumps(series_data(runs_, per_panel)).replace("</", "<\\/")
    parts += [f'<script type="application/json" id="{DATA_ID}">{data}</script>', "</body></html>"]
    return "\n".join(parts)


def _runs_table(runs_: list[RunData]) -> str:
    e = html.escape
    rows = ["<table><tr><th>run</th><th>directory</th><th>status</th><th>steps</th>"
            "<th>held-out accuracy</th></tr>"]
    for run in runs_:
        last = run.rows[-1]["step"]
        planned = run.planned_steps
        steps = f"{last:g}" + (f" of {planned}" if planned is not None else "")
        s = run.summary or {}
        acc = f"{_fmt(s.get('eval_accuracy_start'))} → {_fmt(s.get('eval_accuracy_end'))}" if s else _last_accuracy(run)
        note = f" ({run.unreadable_lines} unreadable line(s) skipped)" if run.unreadable_lines else ""
        rows.append(f"<tr><td>{e(run.label)}</td><td><code>{e(str(run.run_dir))}</code></td>"
                    f"<td>{e(run.status)}{e(note)}</td><td>{e(steps)}</td><td>{e(acc)}</td></tr>")
    rows.append("</table>")
    return "\n".join(rows)


def _last_accuracy(run: RunData) -> str:
    for row in reversed(run.rows):
        if isinstance(row.get("eval/accuracy"), (int, float)):
            return f"{row['eval/accuracy']:.3f} (step {row['step']})"
    return "not measured yet"


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "n/a"


def _config_table(runs_: list[RunData]) -> str:
    e = html.escape
    if len(runs_) > 1:
        heading, configs, names = "Config differences between the runs", [r.config for r in runs_], [r.label for r in runs_]
    else:
        try:
            defaults = default_config()
        except Exception:  # noqa: BLE001 - without plugins the comparison is left out, not the report
            return ""
        heading, configs, names = "Settings that differ from the defaults", [runs_[0].config, defaults], \
            [runs_[0].label, "default"]
    diffs = config_differences(configs)
    if not diffs:
        return f"<h2>{e(heading)}</h2><p class='muted'>none</p>"
    head = "".join(f"<th>{e(n)}</th>" for n in names)
    body = "".join(
        f"<tr><td><code>{e(k)}</code></td>" + "".join(f"<td>{e(_value(v))}</td>" for v in values) + "</tr>"
        for k, values in diffs
    )
    return f"<h2>{e(heading)}</h2><table><tr><th>key</th>{head}</tr>{body}</table>"


def _value(v: Any) -> str:
    return "—" if v is None else json.dumps(v) if not isinstance(v, str) else v


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
img { max-width: 100%; } .muted { color: #666; font-size: 0.9em; }
"""
