"""`forge report` of ``forge eval`` results folders: one HTML table, the evaluations side by
side (one column each): mean@k, pass@k, the reward and every reward component with their
confidence intervals, then the same per source. The numbers are in the page as JSON too."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from forgerl.errors import UserError

SUMMARY_FILE = "eval_summary.json"  # forgerl.runloop.eval_run.SUMMARY_FILE (the report imports no run loop)


def is_eval_dir(path: str | Path) -> bool:
    return (Path(path) / SUMMARY_FILE).is_file()


def load(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(path) / SUMMARY_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {Path(path) / SUMMARY_FILE}: {exc}") from None
    if not isinstance(data, dict) or "k" not in data:
        raise UserError(f"{Path(path) / SUMMARY_FILE} is not a forge eval summary")
    return data


def rows_of(summary: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """``metric name -> interval`` of one summary (or of one source's block)."""
    k = summary["k"]
    out = {f"{prefix}mean@{k}": summary.get(f"mean@{k}") or {}}
    out.update({f"{prefix}{name}": v for name, v in (summary.get("pass") or {}).items()})
    out[f"{prefix}reward"] = summary.get("reward") or {}
    out.update({f"{prefix}reward/{name}": v for name, v in (summary.get("components") or {}).items()})
    for source, block in (summary.get("sources") or {}).items():
        out.update(rows_of({**block, "sources": None}, f"{source}: "))
    return out


def write_html(dirs: list[str], labels: list[str], path: Path) -> Path:
    summaries = [load(d) for d in dirs]
    names = [labels[i] if i < len(labels) else Path(d).resolve().name for i, d in enumerate(dirs)]
    table = [rows_of(s) for s in summaries]
    metrics = list(dict.fromkeys(m for t in table for m in t))
    e = html.escape
    head = "".join(f"<th>{e(n)}</th>" for n in names)
    facts = "".join(
        f"<tr><td>{e(key)}</td>" + "".join(f"<td>{e(str(s.get(key)))}</td>" for s in summaries) + "</tr>"
        for key in (
            "model",
            "task",
            "environment",
            "temperature",
            "problems",
            "samples",
            "k",
            "confidence",
            "complete",
        )
    )
    body = "".join(
        f"<tr><td><code>{e(m)}</code></td>"
        + "".join(f"<td>{e(_cell(t.get(m)))}</td>" for t in table)
        + "</tr>"
        for m in metrics
    )
    data = json.dumps({"evals": [{"label": n, "dir": str(d), "summary": s}
                                 for n, d, s in zip(names, dirs, summaries)]}).replace("</", "<\\/")  # fmt: skip
    page = "\n".join([
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>forge report: {e(', '.join(names))}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}.muted{color:#666}</style></head><body>",
        f"<h1>forge report: {e(', '.join(names))}</h1>",
        f'<p class="muted">made {e(time.strftime("%Y-%m-%d %H:%M:%S"))} by <code>forge report</code>; '
        "mean [low, high]: the confidence interval over problems (normal approximation)</p>",
        f"<table><tr><th></th>{head}</tr>{facts}</table>",
        f"<h2>Scores</h2><table><tr><th>metric</th>{head}</tr>{body}</table>",
        f'<script type="application/json" id="forge-report-data">{data}</script>', "</body></html>",
    ])  # fmt: skip
    if path.is_dir():
        raise UserError(f"--output {str(path)!r} is a folder: give a file name such as report.html")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {str(path)!r}: {exc.strerror}") from None
    return path


def _cell(v: dict[str, Any] | None) -> str:
    if not v or v.get("mean") is None:
        return "—"
    if v.get("low") is None:
        return f"{v['mean']:.3f}"
    return f"{v['mean']:.3f} [{v['low']:.3f}, {v['high']:.3f}]"
