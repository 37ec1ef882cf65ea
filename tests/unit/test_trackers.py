"""The tracker plugins (forgerl_plugins.trackers) through the run hooks, each against its
real library writing real files, read back with that library (or its file format), and
compared with the rows a real tiny run wrote (tests/unit/data/report_run). A tracker
whose library is not installed here is skipped with the reason (failed under
FORGE_REQUIRE_TRACKERS=1, as in CI, where scripts/setup.sh installs all three); the
behaviour without a library (a note, no error) is tested with every tracker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from forgerl.configuration.config import build_config
from forgerl.events import EVENTS_FILE
from forgerl.registry.plugins import build_registry
from forgerl_plugins.trackers.common import scalars
from tests.helpers.requires import require_tracker

FIXTURE = Path(__file__).parent / "data" / "report_run"
TRACKERS = {name: f"forgerl_plugins.trackers.{name}" for name in ("tensorboard", "wandb", "mlflow")}


@pytest.fixture(autouse=True)
def private_homes(tmp_path, monkeypatch):
    # wandb keeps settings and caches in the home folder; MLflow only in the store.
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("FORGE_RUN_DIR", raising=False)


def rows() -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "metrics.jsonl").read_text().splitlines()]


def events(run_dir: Path) -> list[dict]:
    path = run_dir / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_through_hooks(name: str, run_dir: Path, *sets: str, status: str = "completed",
                      samples: dict[int, list] | None = None) -> None:
    """What the loop does: forge_run_start, forge_step_end per row (then forge_step_samples
    with ``samples[step]`` where given), forge_run_end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    registry = build_registry(entry_points=False, plugins=[TRACKERS[name]], disabled=set())
    config = build_config(sets=list(sets))
    registry.hooks.run_start(config=config, run_dir=run_dir)
    for row in rows():
        registry.hooks.step_end(step=row["step"], metrics=row, run_dir=run_dir)
        if samples and row["step"] in samples:
            registry.hooks.step_samples(step=row["step"], samples=samples[row["step"]], run_dir=run_dir)
    registry.hooks.run_end(summary={"status": status, "eval_accuracy_end": 0.25}, run_dir=run_dir)


def expected_scalars() -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows():
        for key, value in scalars(row).items():
            out.setdefault(key, []).append((row["step"], value))
    return out


def test_scalars_leave_out_the_step_the_clock_and_nulls():
    row = {"step": 3, "time/wall": 1.7e9, "reward/mean": 0.5, "grad_norm": None, "flag": True, "n": 2}
    assert scalars(row) == {"reward/mean": 0.5, "n": 2.0}


def test_tensorboard_writes_every_scalar_of_every_step(tmp_path):
    require_tracker("tensorboard", "pip install 'forgerl[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_through_hooks("tensorboard", tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    expected = expected_scalars()
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), key
    assert any("tensorboard: writing" in e["message"] for e in events(tmp_path))


def test_wandb_offline_writes_the_run_without_a_network(tmp_path):
    require_tracker("wandb", "pip install 'forgerl[wandb]'")
    from tests.helpers.wandb_log import exit_code, history

    run_through_hooks("wandb", tmp_path, "logging.wandb.enabled=true", "logging.tensorboard=false")
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged = history(log)
    assert [r["_step"] for r in logged] == [r["step"] for r in rows()]
    for got, row in zip(logged, rows()):
        assert {k: v for k, v in got.items() if not k.startswith("_")} == pytest.approx(scalars(row))
    assert exit_code(log) == 0


def test_mlflow_file_store_without_a_server(tmp_path):
    require_tracker("mlflow", "pip install 'forgerl[mlflow]'")
    from mlflow.tracking import MlflowClient

    run_through_hooks("mlflow", tmp_path, "logging.mlflow.enabled=true", "logging.mlflow.experiment=tiny",
                      "loop.steps=6")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tiny")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["loop.steps"] == "6" and run.data.params["logging.mlflow.enabled"] == "true"
    assert set(run.data.metrics) == {key.replace("/", ".") for key in expected_scalars()}
    for key, points in expected_scalars().items():
        history = client.get_metric_history(run.info.run_id, key.replace("/", "."))
        got = sorted((m.step, m.value) for m in history)
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points]), key
    # A resumed run continues the same MLflow run.
    run_through_hooks("mlflow", tmp_path, "logging.mlflow.enabled=true", "logging.mlflow.experiment=tiny",
                      status="failed")
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FAILED"


@pytest.mark.parametrize("name, switch", [("tensorboard", "logging.tensorboard=true"),
                                          ("wandb", "logging.wandb.enabled=true"),
                                          ("mlflow", "logging.mlflow.enabled=true")])
def test_a_tracker_without_its_library_is_skipped_with_the_reason(tmp_path, monkeypatch, name, switch):
    import importlib

    module = importlib.import_module(TRACKERS[name])
    monkeypatch.setattr(module._tracker, "module", "forgerl_no_such_library")
    run_through_hooks(name, tmp_path, switch)
    (note,) = [e for e in events(tmp_path) if e["stage"] == "tracker"]
    assert note["state"] == "skipped"
    assert f"{name}: skipped: forgerl_no_such_library is not installed (pip install" in note["message"]
    assert module._tracker.open_runs == {}


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_that_is_off_writes_nothing(tmp_path, name):
    run_through_hooks(name, tmp_path, "logging.tensorboard=false")
    assert events(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failing_tracker_does_not_stop_the_run(tmp_path, monkeypatch):
    from forgerl_plugins.trackers import tensorboard

    writes = []

    class Broken:
        def add_scalar(self, *args):
            writes.append(args)
            raise OSError(28, "No space left on device")

        def close(self):
            raise AssertionError("a tracker that stopped is not closed again")

    monkeypatch.setattr(tensorboard._tracker, "module", "json")
    monkeypatch.setattr(tensorboard.TensorBoard, "open", lambda self, config, run_dir: Broken())
    run_through_hooks("tensorboard", tmp_path)
    assert len(writes) == 1  # the first write failed; the tracker wrote no more
    notes = [e["message"] for e in events(tmp_path) if e["stage"] == "tracker"]
    assert notes[-1].startswith("tensorboard: skipped: stopped after a failed write at step 1: OSError")


def test_trackers_are_registered_plugins_whose_modules_stay_light():
    """Each tracker is an entry point of forgerl's own distribution, and importing it (as
    `forge plugins list` does) loads none of the tracker libraries."""
    import re
    import subprocess
    import sys

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[project.entry-points.forgerl]", 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^(\w+) = "([\w.]+)"', section, flags=re.M))
    for name, module in TRACKERS.items():
        assert declared.get(name) == module, (name, declared)
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TRACKERS.values())
            + "print(sorted(m for m in ('torch', 'pydantic', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def step_samples() -> dict[int, list]:
    from forgerl.samples import SampleRecord

    return {
        2: [SampleRecord(kind="train", step=2, group=0, index=i, reward=float(i), completion=f"answer {i}",
                         prompt="2+2?", advantage=i - 0.5) for i in range(2)],
        4: [SampleRecord(kind="eval", step=4, index=0, reward=0.0, completion="wrong", correct=False,
                         messages=[{"role": "user", "content": "hi"}], error="boom")],
    }


def test_wandb_logs_each_step_s_samples_as_a_table(tmp_path):
    require_tracker("wandb", "pip install 'forgerl[wandb]'")
    from forgerl_plugins.trackers.common import SAMPLE_COLUMNS
    from forgerl_plugins.trackers.wandb import SAMPLES_KEY
    from tests.helpers.wandb_log import history

    run_through_hooks("wandb", tmp_path, "logging.wandb.enabled=true", "logging.tensorboard=false",
                      samples=step_samples())
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged = history(log)
    assert [r["_step"] for r in logged] == [r["step"] for r in rows()]  # the tables join their steps' rows
    # A table is logged as nested keys: samples/_type, samples/path, samples/nrows, ...
    prefix = SAMPLES_KEY + "/"
    tables = {r["_step"]: {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)} for r in logged}
    tables = {step: t for step, t in tables.items() if t}
    assert sorted(tables) == [2, 4] and all(t["_type"] == "table-file" for t in tables.values())
    assert tables[2]["nrows"] == 2 and tables[4]["nrows"] == 1
    (table_file,) = log.parent.glob(f"files/{tables[4]['path']}")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    (row,) = table["data"]
    assert dict(zip(SAMPLE_COLUMNS, row)) == {
        "step": 4, "kind": "eval", "group": None, "index": 0, "problem_id": None, "policy_version": None,
        "reward": 0.0, "advantage": None, "correct": False, "finish_reason": None, "error": "boom", "prompt": "",
        "completion": "wrong", "messages": "[user] hi"}
    for got, row in zip(logged, rows()):  # the metrics are still every row's
        assert {k: v for k, v in got.items() if not k.startswith(("_", prefix))} == pytest.approx(scalars(row))


def test_tensorboard_shows_each_step_s_samples_as_a_text_table(tmp_path):
    require_tracker("tensorboard", "pip install 'forgerl[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugin_util import markdown_to_safe_html

    from forgerl_plugins.trackers.tensorboard import SAMPLES_TAG

    run_through_hooks("tensorboard", tmp_path, samples=step_samples())
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{SAMPLES_TAG}/text_summary")}
    assert sorted(texts) == [2, 4]
    # As TensorBoard's Text tab shows it: one table, a row per record.
    page = markdown_to_safe_html(texts[2])
    assert page.count("<table>") == 1 and page.count("<tr>") == 3, page
    assert "answer 1" in page and "-0.5" in page and "forge samples RUN_DIR --step 2" in page
    assert "boom" in markdown_to_safe_html(texts[4])
    assert len(set(acc.Tags()["scalars"])) == len(expected_scalars()), "the scalars are still every row's"


def test_tensorboard_samples_are_bounded_and_a_models_text_is_data():
    pytest.importorskip("tensorboard")
    from tensorboard.plugin_util import markdown_to_safe_html

    from forgerl.samples import SampleRecord
    from forgerl_plugins.trackers.tensorboard import MAX_CELL, MAX_ROWS, samples_markdown

    hostile = ("| fake | row |\n|---|---|\n# Heading <script>alert(1)</script> [x](javascript:alert(1)) "
               "**bold** `code` \x00\x1b[31m\u2028 <|im_start|>user\r\nend")
    records = [SampleRecord(kind="train", step=3, index=i, reward=float(i % 10), completion=f"c{i} {hostile}")
               for i in range(40)]
    records[5].reward = None
    records.append(SampleRecord(kind="train", step=3, completion="x" * 10_000, reward=5.0))
    text = samples_markdown(records, 3)
    page = markdown_to_safe_html(text)
    assert page.count("<table>") == 1 and page.count("<tr>") == 1 + MAX_ROWS, page
    # The lowest rewards (None first) and the highest, in the order written.
    shown = re.findall(r"<td>c(\d+) ", page)
    assert [int(i) for i in shown] == [0, 5, 9, 10, 19, 20, 29, 39], shown
    for tag in ("<h1>", "<script", "<strong>", "<code>", "href"):
        assert tag not in page, (tag, page[:2000])
    assert "# Heading" in page and "**bold**" in page and "&lt;|im_start|&gt;user" in page
    assert "\x00" not in text and "\x1b" not in text and "\u2028" not in text
    assert len(text) < (MAX_ROWS + 4) * (MAX_CELL * 2 + 200), len(text)


def test_mlflow_logs_each_step_s_samples_as_a_table(tmp_path):
    require_tracker("mlflow", "pip install 'forgerl[mlflow]'")
    from mlflow.tracking import MlflowClient

    from forgerl_plugins.trackers.common import SAMPLE_COLUMNS

    run_through_hooks("mlflow", tmp_path, "logging.mlflow.enabled=true", samples=step_samples())
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("forgerl").experiment_id])
    assert {a.path for a in client.list_artifacts(run.info.run_id, "samples")} == {
        "samples/step-000002.json", "samples/step-000004.json"}
    local = Path(client.download_artifacts(run.info.run_id, "samples/step-000002.json", str(tmp_path / "dl")))
    table = json.loads(local.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    got = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["step"], r["index"], r["reward"], r["completion"], r["advantage"]) for r in got] == [
        (2, 0, 0.0, "answer 0", -0.5), (2, 1, 1.0, "answer 1", 0.5)]
    assert run.info.status == "FINISHED"
