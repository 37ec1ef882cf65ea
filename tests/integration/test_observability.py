"""Seeing a real run: `forge run`'s progress lines without a terminal, `--quiet`,
`forge report` on the run it made (tiny model, hf generator, local scheduler), and the
three trackers (tensorboard, wandb offline, MLflow's file store) holding its metrics.jsonl."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from forgerl_plugins.trackers.common import scalars
from tests.helpers.requires import require_tracker

from ..unit.test_report import embedded_data
from .test_run_e2e import SMALL, forge, metrics

pytestmark = pytest.mark.integration

STEPS = 3
RUN = [*SMALL, "--steps", str(STEPS), "--set", "loop.eval_every=2",
       "--set", "logging.wandb.enabled=true", "--set", "logging.mlflow.enabled=true"]


def tracker_env(home: Path) -> dict[str, str]:
    """The tracker plugins load through entry points; an environment installed before they
    existed (`make setup` re-installs when pyproject.toml changes) gets them by import path.
    wandb keeps its settings and caches in ``home``, not the user's."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="forgerl")}
    missing = [f"forgerl_plugins.trackers.{n}" for n in ("tensorboard", "wandb", "mlflow") if n not in names]
    env = {var: str(home / var.lower()) for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    return {**env, "FORGE_PLUGINS": ",".join(missing)} if missing else env


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("observed") / "run"
    proc = forge("run", *RUN, "--output", str(out), env=tracker_env(out.parent / "home"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_progress_lines_from_the_start_without_a_terminal(tiny_run):
    run_dir, stderr = tiny_run
    said = [line for line in stderr.splitlines() if line.startswith("forge: ")]
    steps = [i for i, line in enumerate(said) if line.startswith("forge: step ")]
    assert len(steps) == STEPS, stderr
    before = said[: steps[0]]
    # Before step 1: what started, and each phase of the start-up, in order.
    order = ["started trainer", "importing torch", "preparing model tiny", "building trainer fsdp",
             "starting generator hf", "evaluating the base model", "training: steps 1 to 3"]
    at = [next((i for i, line in enumerate(before) if needle in line), None) for needle in order]
    assert None not in at and at == sorted(at), (order, at, before)
    assert all(re.match(r"forge: \[\d+:\d\d\] trainer-0: ", line) for line in before[1:]), before
    rows = metrics(run_dir)
    for line, row in zip((said[i] for i in steps), rows):
        assert line.startswith(f"forge: step {row['step']}/{STEPS}  reward {row['reward/mean']:.3f}"), line
        assert "s/step  ETA " in line
    assert f"accuracy {rows[1]['eval/accuracy']:.3f}" in said[steps[1]]
    recorded = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["stage"] for e in recorded} >= {"worker", "model", "trainer", "generator", "eval", "loop"}


def test_quiet_prints_no_progress(tmp_path):
    out = tmp_path / "run"
    proc = forge("run", *SMALL, "--steps", "1", "--quiet", "--set", "loop.eval_at_start=false",
                 "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith(("forge: [", "forge: step"))]
    assert "forge: run completed" in proc.stderr
    assert (out / "events.jsonl").is_file()  # still recorded, only not shown


def test_report_of_the_run_plots_its_metrics(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    html = tmp_path / "report.html"
    proc = forge("report", str(run_dir), "--output", str(html))
    assert proc.returncode == 0, proc.stderr
    data = embedded_data(html.read_text())
    (run,) = data["runs"]
    assert run["status"] == "completed"
    rows = metrics(run_dir)
    for panel, key in [("reward", "reward/mean"), ("grad_norm", "grad_norm"), ("entropy", "entropy"),
                       ("logprob_gap", "logprob_gap/mean"), ("completion_length", "completion/mean_tokens"),
                       ("staleness", "staleness/mean"), ("accuracy", "eval/accuracy")]:
        plotted = run["panels"][panel][key]
        expected = [r for r in rows if r.get(key) is not None]
        assert plotted["step"] == [r["step"] for r in expected], key
        assert plotted["value"] == [r[key] for r in expected], key
    assert run["eval_accuracy_start"] == json.loads((run_dir / "summary.json").read_text())["eval_accuracy_start"]


def test_tensorboard_by_default_or_a_note_why_not(tiny_run):
    run_dir, stderr = tiny_run
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        assert "tensorboard: skipped: tensorboard is not installed (pip install 'forgerl[tensorboard]'" in stderr
        assert not (run_dir / "tensorboard").exists()
        return
    assert f"tensorboard: writing {run_dir / 'tensorboard'}" in stderr
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rows = metrics(run_dir)
    for key in ("reward/mean", "grad_norm", "eval/accuracy"):
        points = [(e.step, e.value) for e in acc.Scalars(key)]
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert [p[0] for p in points] == [e[0] for e in expected], key
        assert [p[1] for p in points] == pytest.approx([e[1] for e in expected], rel=1e-6), key


def test_wandb_offline_run_holds_every_row_of_metrics_jsonl(tiny_run):
    """The W&B tracker on trainer rank 0 of a real run (a worker process that leaves with
    os._exit): the offline run file has one history row per step with the step's numbers,
    and a clean exit."""
    require_tracker("wandb", "pip install 'forgerl[wandb]'")
    from tests.helpers.wandb_log import exit_code, history

    run_dir, stderr = tiny_run
    assert f"wandb: writing {run_dir / 'wandb'}" in stderr
    from forgerl_plugins.trackers.wandb import SAMPLES_KEY

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged, rows = history(log), metrics(run_dir)
    assert [r["_step"] for r in logged] == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    table = SAMPLES_KEY + "/"
    for got, row in zip(logged, rows):
        assert {k: v for k, v in got.items() if not k.startswith(("_", table))} == pytest.approx(scalars(row)), \
            row["step"]
        # Each step's samples table: its 8 training samples and 4 held-out ones (step 1: the
        # evaluation before training; 2 and 3: after the step, loop.eval_every=2 and the end).
        assert got[table + "nrows"] == 8 + 4, row["step"]
    assert exit_code(log) == 0


def test_mlflow_file_store_holds_every_row_of_metrics_jsonl(tiny_run, monkeypatch):
    require_tracker("mlflow", "pip install 'forgerl[mlflow]'")
    from mlflow.tracking import MlflowClient

    # What a user reading the store sets too (docs/observability.md): MLflow 3 refuses a
    # file store unless told that one is wanted.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    run_dir, stderr = tiny_run
    uri = (run_dir / "mlruns").resolve().as_uri()
    assert f"mlflow: writing {uri}" in stderr
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("forgerl").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["loop.steps"] == str(STEPS)
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in metrics(run_dir):
        for key, value in scalars(row).items():
            expected.setdefault(key.replace("/", "."), []).append((row["step"], value))
    assert set(run.data.metrics) == set(expected)
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert tables == {f"samples/step-{s:06d}.json" for s in range(1, STEPS + 1)}
    for key, points in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points]), key


def test_the_run_records_its_samples(tiny_run):
    """Every sample of each step (2 prompts x 4) and of each held-out evaluation (at start,
    step 2 and the end), with what the metrics row says of them; `forge samples` shows them."""
    from forgerl.samples import read_samples

    run_dir, _ = tiny_run
    records = read_samples(run_dir)
    rows = {r["step"]: r for r in metrics(run_dir)}
    for step in range(1, STEPS + 1):
        train = [r for r in records if r.kind == "train" and r.step == step]
        assert len(train) == 2 * 4, step
        assert [(r.group, r.index) for r in train] == [(g, i) for g in range(2) for i in range(4)]
        assert sum(r.reward for r in train) / len(train) == pytest.approx(rows[step]["reward/mean"])
        assert all(r.policy_version == step - 1 and r.prompt and r.completion_tokens >= 1 for r in train)
        assert all(r.advantage is not None and r.finish_reason in ("stop", "length") for r in train)
        # Advantages are group-relative: they sum to zero within a group.
        for g in range(2):
            assert sum(r.advantage for r in train if r.group == g) == pytest.approx(0.0, abs=1e-5)
    evals = {}
    for r in records:
        if r.kind == "eval":
            evals.setdefault(r.step, []).append(r)
    assert sorted(evals) == [0, 2, 3]
    for step, recs in evals.items():
        assert len(recs) == 4 and all(r.correct is not None for r in recs), step
        if step:
            assert sum(r.correct for r in recs) / 4 == pytest.approx(rows[step]["eval/accuracy"])
    proc = forge("samples", str(run_dir), "--step", "2", "--kind", "train", "--worst", "--json")
    assert proc.returncode == 0, proc.stderr
    shown = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(shown) == 8 and [s["reward"] for s in shown] == sorted(s["reward"] for s in shown)
