"""Which model names name a run (forgerl.models.from_run.find): a run directory, run:NAME (the
directory, else runs/NAME) and a checkpoint folder do; model names, model folders and hub
ids do not; a run without a checkpoint is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgerl.checkpoints import checkpoint
from forgerl.checkpoints.checkpoint_format import Snapshot
from forgerl.errors import ConfigError
from forgerl.models.from_run import find


def make_run(root: Path, steps: tuple[int, ...]) -> Path:
    root.mkdir(parents=True)
    (root / "config.yaml").write_text("model:\n  name: tiny\n")
    for step in steps:
        state = {"step": step, "policy_version": 0, "task_state": {}, "next_rollout_index": step,
                 "time_totals": {}, "eval_start": None, "eval_last": None}  # fmt: skip
        from forgerl.checkpoints.checkpoint_format import capture_rng

        rng, arrays = capture_rng()
        checkpoint.save(root, step, Snapshot({**state, "rng": rng}, [], arrays), lambda p: (p / "w").write_text("x"),
                        keep=5)  # fmt: skip
    return root


def test_runs_and_their_checkpoints_are_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path / "runs" / "sft", (2, 4))
    newest = run / "checkpoints" / "step-000004"
    for name in (str(run), "runs/sft", "run:sft", f"run:{run}"):
        found = find(name)
        assert found is not None and found.folder == newest.resolve() and found.step == 4, name
    older = find(str(run / "checkpoints" / "step-000002"))
    assert older is not None and older.step == 2 and older.run_dir == run.resolve()


def test_models_are_not_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in ("tiny", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M", str(folder), "missing/folder/x"):
        assert find(name) is None, name


def test_a_run_without_a_checkpoint_or_no_run_at_all_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "runs" / "fresh", ())
    with pytest.raises(ConfigError, match="is a run without a checkpoint yet"):
        find("run:fresh")
    with pytest.raises(ConfigError, match="no run 'gone' \\(neither gone nor runs/gone is a run directory"):
        find("run:gone")
