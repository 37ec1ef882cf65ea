"""`forge report`: the series it plots are metrics.jsonl's, for finished, running and
failed runs; a path that is not a run is a one-line error.

tests/unit/data/report_run holds metrics.jsonl, config.yaml and summary.json as a real
tiny run wrote them (`forge run --model tiny --generator hf --steps 6 --reward format
--set loop.eval_every=2 ...`)."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest

from forgerl.report import build_report, load_runs
from forgerl.report.data import config_differences, read_rows, series, wall_seconds
from forgerl.report.panels import PANELS, all_series, draw, overview
from forgerl.report.render import DATA_ID

from .test_cli import assert_one_line_error, forge

pytest.importorskip("matplotlib")

FIXTURE = Path(__file__).parent / "data" / "report_run"


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def copy_run(tmp_path: Path, name: str = "run") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURE, dst)
    return dst


def embedded_data(html_text: str) -> dict:
    match = re.search(rf'<script type="application/json" id="{DATA_ID}">(.*?)</script>', html_text, re.S)
    assert match, "the report keeps no data"
    return json.loads(match.group(1).replace("<\\/", "</"))


def test_every_plotted_series_is_the_metrics_column():
    rows = rows_of(FIXTURE)
    (run,) = load_runs([str(FIXTURE)])
    per_panel = all_series([run])
    # The plots docs/observability.md lists for forge report, each with data from this run.
    for pid in ("reward", "reward_components", "accuracy", "completion_length", "truncation", "staleness",
                "dropped", "logprob_gap", "entropy", "grad_norm", "time", "rollout_time"):
        assert pid in per_panel, pid
    checked = 0
    for pid, (run_series,) in per_panel.items():
        for s in run_series:
            if s.key == "time/other":
                continue
            expected = [(r["step"], r[s.key]) for r in rows if r.get(s.key) is not None]
            assert list(zip(s.steps, s.values)) == expected, (pid, s.key)
            checked += 1
    assert checked >= 15
    # Accuracy only on evaluating steps: every 2nd step and the last.
    assert series(run, "eval/accuracy").steps == [2, 4, 6]


def test_step_time_parts_add_up_to_the_step_time():
    (run,) = load_runs([str(FIXTURE)])
    (time_series,) = all_series([run])["time"]
    totals = [sum(s.values[i] for s in time_series) for i in range(len(run.rows))]
    assert totals == pytest.approx([r["time/step"] for r in run.rows])


def test_wall_time_is_time_wall_from_the_first_step_start():
    rows = rows_of(FIXTURE)
    walls, what = wall_seconds(rows)
    start = rows[0]["time/wall"] - rows[0]["time/step"]
    assert walls == pytest.approx([r["time/wall"] - start for r in rows])
    assert walls[0] == pytest.approx(rows[0]["time/step"]) and "wall-clock" in what
    old = [{k: v for k, v in r.items() if k != "time/wall"} for r in rows]
    sums, what = wall_seconds(old)
    assert sums[-1] == pytest.approx(sum(r["time/step"] for r in rows)) and "time/step" in what


def test_the_lines_drawn_are_the_series():
    (run,) = load_runs([str(FIXTURE)])
    per_panel = all_series([run])
    panel = next(p for p in PANELS if p.id == "grad_norm")
    fig = draw(panel, [run], per_panel["grad_norm"])
    by_step, by_wall = fig.axes[0], fig.axes[1]
    rows = rows_of(FIXTURE)
    (line,) = [ln for ln in by_step.get_lines() if ln.get_gid() == "0:grad_norm"]
    assert list(line.get_xdata()) == [r["step"] for r in rows]
    assert list(line.get_ydata()) == [r["grad_norm"] for r in rows]
    (line,) = [ln for ln in by_wall.get_lines() if ln.get_gid() == "0:grad_norm"]
    assert list(line.get_xdata()) == pytest.approx(wall_seconds(rows)[0])


def test_the_overview_draws_the_same_series_for_every_run(tmp_path):
    a, b = copy_run(tmp_path, "a"), copy_run(tmp_path, "b")
    runs_ = load_runs([str(a), str(b)])
    fig = overview(runs_, all_series(runs_))
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["Reward", "Held-out accuracy", "Completion length", "Entropy", "Gradient norm",
                      "Where a step's time goes"]
    rows = rows_of(FIXTURE)
    entropy = fig.axes[3]
    for index in (0, 1):
        (line,) = [ln for ln in entropy.get_lines() if ln.get_gid() == f"{index}:entropy"]
        assert list(line.get_ydata()) == [r["entropy"] for r in rows]
    # Several runs: the step time is one line per run (stacked areas would hide each other).
    (line,) = [ln for ln in fig.axes[5].get_lines() if ln.get_gid() == "1:time/step"]
    assert list(line.get_ydata()) == [r["time/step"] for r in rows]


def test_html_report_is_self_contained_and_keeps_the_series(tmp_path):
    out = tmp_path / "r.html"
    (written,) = build_report([str(FIXTURE)], out)
    assert written == out
    text = out.read_text()
    assert "<img" in text and 'src="http' not in text and "<link" not in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) >= 13 and 'id="overview"' in text
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    data = embedded_data(text)
    (run,) = data["runs"]
    assert run["status"] == "completed"
    rows = rows_of(FIXTURE)
    reward = run["panels"]["reward"]["reward/mean"]
    assert reward["step"] == [r["step"] for r in rows]
    assert reward["value"] == [r["reward/mean"] for r in rows]
    # A single run is compared with the defaults: it changed the reward and the steps.
    assert "Settings that differ from the defaults" in text and "loop.steps" in text


def test_a_running_run_with_a_torn_last_line(tmp_path):
    run_dir = copy_run(tmp_path)
    (run_dir / "summary.json").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "reward/mean": 0.')  # the writer is mid-line
    rows, bad = read_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and bad == 1
    (out,) = build_report([str(run_dir)])
    assert out == run_dir / "report.html"
    text = out.read_text()
    assert "running (no summary.json yet)" in text and "1 unreadable line(s) skipped" in text
    assert embedded_data(text)["runs"][0]["panels"]["reward"]["reward/mean"]["step"] == [1, 2, 3, 4, 5, 6]


def test_a_failed_run(tmp_path):
    run_dir = copy_run(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:3]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (out,) = build_report([str(run_dir)], tmp_path / "f.html")
    data = embedded_data(out.read_text())
    assert data["runs"][0]["status"] == "failed"
    assert data["runs"][0]["panels"]["reward"]["reward/mean"]["step"] == [1, 2, 3]
    assert "3 of 6" in out.read_text()


def test_several_runs_overlaid_with_their_config_differences(tmp_path):
    a, b = copy_run(tmp_path, "a"), copy_run(tmp_path, "b")
    config = (b / "config.yaml").read_text()
    assert "lr: 0.001" in config
    (b / "config.yaml").write_text(config.replace("lr: 0.001", "lr: 0.003"))
    (b / "metrics.jsonl").write_text("\n".join(
        json.dumps({**r, "reward/mean": r["reward/mean"] / 2}) for r in rows_of(b)) + "\n")
    (out,) = build_report([str(a), str(b)], tmp_path / "cmp.html", labels=["low-lr", "high-lr"])
    text = out.read_text()
    data = embedded_data(text)
    assert [r["label"] for r in data["runs"]] == ["low-lr", "high-lr"]
    halves = data["runs"][1]["panels"]["reward"]["reward/mean"]["value"]
    assert halves == [r["reward/mean"] / 2 for r in rows_of(a)]
    assert "Config differences between the runs" in text
    assert re.search(r"<code>trainer\.options\.lr</code></td><td>0\.001</td><td>0\.003</td>", text)
    # Runs of the same name are told apart.
    runs_ = load_runs([str(a), str(a)])
    assert [r.label for r in runs_] == ["a", "a (2)"]


def test_config_differences():
    diffs = config_differences([{"loop": {"steps": 3, "seed": 1}, "rewards": [{"name": "x"}], "output": "a"},
                                {"loop": {"steps": 5, "seed": 1}, "rewards": [{"name": "x"}, {"name": "y"}],
                                 "output": "b"}])
    assert diffs == [("loop.steps", [3, 5]), ("rewards.1.name", [None, "y"])]


def test_png_format_writes_one_image_per_panel(tmp_path):
    written = build_report([str(FIXTURE)], tmp_path / "pngs", fmt="png")
    names = {p.name for p in written}
    assert {"overview.png", "reward.png", "accuracy.png", "time.png", "grad_norm.png"} <= names
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    # A .png name: the overview alone.
    (single,) = build_report([str(FIXTURE)], tmp_path / "pics" / "demo.png", fmt="png")
    assert single == tmp_path / "pics" / "demo.png" and single.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in (tmp_path / "pics").iterdir()] == ["demo.png"]


def test_cli_report_and_its_user_errors(tmp_path):
    run_dir = copy_run(tmp_path)
    proc = forge("report", str(run_dir), "--output", str(tmp_path / "out.html"), "--label", "mine")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "out.html")
    assert embedded_data((tmp_path / "out.html").read_text())["runs"][0]["label"] == "mine"

    assert_one_line_error(forge("report", str(tmp_path / "nowhere")), "is not a directory")
    assert_one_line_error(forge("report", str(tmp_path)), "has no metrics.jsonl", "not a run directory")
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "config.yaml").write_text("loop: {steps: 3}\n")
    assert_one_line_error(forge("report", str(starting)), "has not finished a step yet")
    (starting / "metrics.jsonl").write_text('{"step": 1, "rew')
    assert_one_line_error(forge("report", str(starting)), "no complete rows yet")
    assert_one_line_error(forge("report", str(run_dir), "--label", "a", "--label", "b"), "--label")
    assert_one_line_error(forge("report", str(run_dir), "--output", str(tmp_path)), "is a folder")
    assert_one_line_error(forge("report"), "Missing argument")


def test_report_has_a_page_of_samples_per_step(tmp_path):
    """The run's samples, at most PER_STEP per step (the worst and the best), kept as JSON
    in the page for its filters; markup in a completion stays text; a run without samples
    has no samples section."""
    from forgerl.report.samples import PER_STEP, SAMPLES_ID
    from forgerl.samples import SampleRecord, SampleWriter

    bare = copy_run(tmp_path, "bare")
    build_report([str(bare)], tmp_path / "bare.html")
    assert SAMPLES_ID not in (tmp_path / "bare.html").read_text()

    run = copy_run(tmp_path)
    records = [SampleRecord(kind="train", step=s, reward=float(i), completion=f"s{s} r{i}", group=i // 4, index=i % 4)
               for s in (1, 2) for i in range(PER_STEP + 4)]
    records.append(SampleRecord(kind="eval", step=2, reward=0.0, completion="</script><b>bold</b>", error="boom"))
    SampleWriter.for_run(run).write(records)
    out = tmp_path / "report.html"
    build_report([str(run)], out)
    text = out.read_text()
    match = re.search(rf'<script type="application/json" id="{SAMPLES_ID}">(.*?)</script>', text, re.S)
    assert match, "no samples data in the page"
    (shown,) = json.loads(match.group(1))
    assert shown["label"] == "run"
    train = [r for r in shown["records"] if r["kind"] == "train" and r["step"] == 1]
    rewards = sorted(r["reward"] for r in train)
    assert len(train) == PER_STEP and rewards[0] == 0.0 and rewards[-1] == PER_STEP + 3
    (ev,) = [r for r in shown["records"] if r["kind"] == "eval"]
    assert ev["completion"] == "</script><b>bold</b>" and ev["error"] == "boom"
    assert "<b>bold</b>" not in text  # only inside the JSON, escaped
