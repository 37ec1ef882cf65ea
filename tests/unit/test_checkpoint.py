"""Checkpoint directories: atomic commit, `latest`, pruning, recovery from a crash mid-save."""

from __future__ import annotations

import json

import pytest

from forgerl import checkpoint as ckpt
from forgerl.errors import CheckpointError
from forgerl.metrics import MetricsWriter


def save(run_dir, step, keep=2):
    tmp = ckpt.prepare(run_dir, step)
    (tmp / "trainer" / "weights").write_text(f"step {step}")
    return ckpt.commit(run_dir, step, {"step": step}, [f"pending after {step}"], keep=keep)


def test_latest_is_the_newest_committed(tmp_path):
    assert ckpt.latest(tmp_path) is None
    save(tmp_path, 1)
    save(tmp_path, 2)
    path = ckpt.latest(tmp_path)
    assert path.name == "step-000002"
    state, rollouts = ckpt.load_loop_state(path)
    assert state == {"step": 2} and rollouts == ["pending after 2"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(tmp_path):
    save(tmp_path, 1)
    tmp = ckpt.prepare(tmp_path, 2)  # the trainer state is being written...
    (tmp / "trainer" / "weights").write_text("half")
    # ...and the process dies here: nothing committed.
    assert ckpt.latest(tmp_path).name == "step-000001"
    ckpt.clean_staging(tmp_path)
    assert not tmp.exists()
    assert (ckpt.latest(tmp_path) / "trainer" / "weights").read_text() == "step 1"


def test_only_keep_newest(tmp_path):
    for step in range(1, 5):
        save(tmp_path, step, keep=2)
    kept = sorted(p.name for p in ckpt.root(tmp_path).glob("step-*"))
    assert kept == ["step-000003", "step-000004"]


def test_latest_pointing_at_an_incomplete_folder_is_an_error(tmp_path):
    save(tmp_path, 1)
    (ckpt.latest(tmp_path) / ckpt.LOOP_STATE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.latest(tmp_path)


def test_resumed_metrics_drop_rows_after_the_checkpoint(tmp_path):
    rows = [{"step": i, "reward/mean": i / 10} for i in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    writer.write(3, {"step": 3, "reward/mean": 0.9})
    writer.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
