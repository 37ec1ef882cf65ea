"""Checkpoint folders: safe formats (nothing unpickled), strict checks, atomic commit,
fallback to the previous checkpoint, and errors when the disk is full or unwritable."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.checkpoints import checkpoint as ckpt
from forgerl.checkpoints.checkpoint_format import Snapshot, capture_rng, restore_rng
from forgerl.errors import CheckpointUnusable, CheckpointWriteError
from forgerl.rollouts.rollout import RolloutBatch
from forgerl.runloop.metrics import MetricsWriter
from forgerl.types import Completion, Episode, Problem
from tests.helpers.timing import scaled

REPO = Path(__file__).resolve().parents[2]


def rollouts(start: int, n: int = 2) -> list[RolloutBatch]:
    batches = []
    for index in range(start, start + n):
        episodes = [
            Episode(
                problem=Problem(
                    id=f"p{index}-{g}",
                    prompt=[{"role": "user", "content": f"what is {g} + {index}?"}] if g else "plain prompt",
                    answer=str(g + index),
                    metadata={"a": g, "numbers": [1, 2, 3], "nested": {"x": 0.5}},
                ),
                group_id=g,
                prompt_token_ids=[1, 2, 3 + g, 400 + index],
                completion=Completion(
                    token_ids=list(range(g + 1)),
                    logprobs=[-0.1 * (k + 1) / 3 for k in range(g + 1)],  # not round in binary
                    finish_reason="length" if g else "stop",
                    policy_version=index,
                    text=f"answer ünïcode {g}",
                ),
                reward=0.25 * g,
                reward_components={"format": 1.0, "math/correct": 0.0},
                reward_failed=g == 2,
                advantage=-0.7 + g,
                error="reward timed out" if g == 2 else None,  # sample records keep them
                messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}] if g == 1 else None,
            )
            for g in range(3)
        ]
        batches.append(
            RolloutBatch(index=index, episodes=episodes, policy_version=index, task_state={"position": index},
                         gen_seconds=1.5, reward_seconds=0.25, gen_tokens=6, rewards_failed=1, extra={"x": 2.0})
        )
    return batches


def snapshot(step: int, pending: int = 2) -> Snapshot:
    rng, arrays = capture_rng()
    state = {
        "step": step, "policy_version": step, "task_state": {"position": step, "seed": 0},
        "next_rollout_index": step + pending, "time_totals": {"train": 1.25, "checkpoint": 0.0},
        "eval_start": 0.125, "eval_last": None, "rng": rng,
    }
    return Snapshot(state=state, rollouts=rollouts(step, pending), arrays=arrays)


def write_trainer(folder: Path) -> None:
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    (folder / ".metadata").write_text("trainer metadata")


def save(run_dir: Path, step: int, keep: int = 2, writer=write_trainer) -> Path:
    return ckpt.save(run_dir, step, snapshot(step), writer, keep=keep)


class Bomb:
    """Unpickling this creates ``path``: proof that code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ------------------------------------------------------------------------------ formats


def test_snapshot_round_trips_exactly(tmp_path):
    path = save(tmp_path, 3)
    loaded = ckpt.load(path)
    original = snapshot(3)
    assert loaded.rollouts == original.rollouts  # dataclass equality: every field, every float
    state = {k: v for k, v in loaded.state.items() if k != "rng"}
    assert state == {k: v for k, v in original.state.items() if k != "rng"}
    assert not list(path.rglob("*.pkl")), "nothing may be pickled"
    names = sorted(p.name for p in path.iterdir())
    assert names == ["arrays.safetensors", "loop.json", "manifest.json", "trainer"], names


def test_rng_state_round_trips():
    import random

    import numpy as np
    import torch

    rng, arrays = capture_rng()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    snap = Snapshot(state={"rng": json.loads(json.dumps(rng))}, arrays=arrays)
    restore_rng(snap)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_a_pickle_bomb_in_place_of_a_state_file_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    for name in ("loop.json", "arrays.safetensors", "manifest.json"):
        run = tmp_path / name
        path = save(run, 1)
        bomb = pickle.dumps(Bomb(marker))
        (path / name).write_bytes(bomb)
        if name != "manifest.json":  # a consistent manifest: only the content check can refuse it
            manifest = json.loads((path / "manifest.json").read_text())
            manifest["files"][name] = len(bomb)
            (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointUnusable) as info:
            ckpt.load(path)
        message = str(info.value)
        assert str(path / name) in message and "\n" not in message, message
        assert not marker.exists(), f"loading {name} ran code from the checkpoint"


def corrupt_loop_state(path: Path, edit) -> None:
    state = json.loads((path / "loop.json").read_text())
    edit(state)
    data = json.dumps(state).encode()
    (path / "loop.json").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["loop.json"] = len(data)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.update(step="3"), "step must be an integer"),
        (lambda s: s.update(policy_version=True), "policy_version must be an integer"),
        (lambda s: s["rng"]["python"].update(state=[1, 2]), "rng.python.state must hold 625 items"),
        (lambda s: s["rng"]["numpy"]["key"].__setitem__(0, "x"), "rng.numpy.key[0] must be an integer"),
        (lambda s: s["pending_rollouts"][0]["episodes"][1].update(reward="1"), "reward must be a number"),
        (lambda s: s["pending_rollouts"][0]["episodes"][0]["completion"].update(len=99), "more tokens"),
        (lambda s: s["pending_rollouts"][1].update(surprise=1), "unknown surprise"),
        (lambda s: s.pop("task_state"), "lacks task_state"),
        (lambda s: s.update(version=2), "version is 2"),
    ],
)
def test_loop_state_with_wrong_types_is_refused(tmp_path, edit, field):
    path = save(tmp_path, 3)
    corrupt_loop_state(path, edit)
    with pytest.raises(CheckpointUnusable, match="loop.json") as info:
        ckpt.load(path)
    assert field in str(info.value)


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    path = save(tmp_path, 1)
    arrays = path / "arrays.safetensors"
    arrays.write_bytes(arrays.read_bytes()[:-10])
    with pytest.raises(CheckpointUnusable, match="truncated"):
        ckpt.load(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["arrays.safetensors"] = arrays.stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointUnusable, match="not a complete safetensors file"):
        ckpt.load(path)


def test_a_manifest_cannot_point_outside_the_checkpoint(tmp_path):
    path = save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointUnusable, match="outside the checkpoint"):
        ckpt.load(path)


# ------------------------------------------------------------------------------ folders


def test_latest_is_the_newest_committed(tmp_path):
    assert ckpt.latest(tmp_path) is None
    save(tmp_path, 1)
    save(tmp_path, 2)
    assert ckpt.latest(tmp_path).name == "step-000002"
    assert (ckpt.root(tmp_path) / "latest").read_text() == "step-000002"


def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(tmp_path):
    save(tmp_path, 1)

    def dies(folder):
        (folder / "weights.bin").write_text("half")
        raise KeyboardInterrupt  # the process is stopped mid-save

    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, writer=dies)
    assert ckpt.latest(tmp_path).name == "step-000001"
    assert not ckpt.staging_dir(tmp_path, 2).exists()


def test_only_keep_newest(tmp_path):
    for step in range(1, 5):
        save(tmp_path, step, keep=2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000004", "step-000003"]


def test_the_same_step_saved_twice_keeps_one_folder(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000002"]
    assert ckpt.load(ckpt.latest(tmp_path)).state["step"] == 2


# ------------------------------------------------------------------------------ fallback


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / "loop.json").unlink(),
        lambda p: (p / "loop.json").write_text("{not json"),
        lambda p: (p / "trainer" / "weights.bin").write_bytes(b"w" * 10),  # truncated trainer file
        lambda p: (p / "trainer" / ".metadata").unlink(),
        lambda p: (p / "manifest.json").unlink(),
    ],
    ids=["loop-missing", "loop-unparseable", "trainer-truncated", "trainer-missing", "no-manifest"],
)
def test_a_corrupted_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog, damage):
    save(tmp_path, 1)
    bad = save(tmp_path, 2)
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="forgerl.checkpoints.checkpoint"):
        found = ckpt.restore(tmp_path, lambda folder: None, keep=2)
    assert found is not None and found[0].name == "step-000001"
    assert found[1].state["step"] == 1
    warning = caplog.messages[-1]
    assert str(bad) in warning and "step-000001" in warning, warning


def test_a_checkpoint_the_trainer_refuses_is_skipped_too(tmp_path, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    loaded = []

    def load_trainer(folder):
        if folder.parent.name == "step-000002":
            raise CheckpointUnusable(f"{folder}/.metadata: refused")
        loaded.append(folder.parent.name)

    with caplog.at_level(logging.WARNING, logger="forgerl.checkpoints.checkpoint"):
        path, _ = ckpt.restore(tmp_path, load_trainer, keep=2)
    assert path.name == "step-000001" and loaded == ["step-000001"]
    assert "refused" in caplog.text


def test_no_usable_checkpoint_is_one_clear_error(tmp_path):
    for step in (1, 2):
        (save(tmp_path, step) / "loop.json").write_text("[]")
    with pytest.raises(CheckpointUnusable) as info:
        ckpt.restore(tmp_path, lambda folder: None, keep=2)
    message = str(info.value)
    assert "step-000002" in message and "step-000001" in message and "\n" not in message
    assert "start the run over" in message


def test_with_keep_1_the_error_says_there_is_no_previous(tmp_path):
    (save(tmp_path, 1, keep=1) / "arrays.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointUnusable, match="checkpoint.keep is 1, so no earlier checkpoint was kept"):
        ckpt.restore(tmp_path, lambda folder: None, keep=1)


# ------------------------------------------------------------------------------ disk faults


def enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["trainer", "loop-state"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path, monkeypatch, where):
    save(tmp_path, 1)

    def full_trainer(folder):
        raise enospc(folder / "__0_0.distcp")

    writer = write_trainer
    if where == "trainer":
        writer = full_trainer
    else:
        real = ckpt._write_durably

        def full(path, data):
            if path.name == "arrays.safetensors":
                raise enospc(path)
            real(path, data)

        monkeypatch.setattr(ckpt, "_write_durably", full)
    with pytest.raises(CheckpointWriteError) as info:
        save(tmp_path, 2, writer=writer)
    message = str(info.value)
    assert "\n" not in message
    assert "no space left on device" in message
    assert message.startswith("checkpoint of step 2 not written: no space left on device (checkpoints/.tmp-step-000002")
    assert "step-000001 is intact" in message and "free space" in message
    assert f"forge run --resume {tmp_path}" in message
    assert ckpt.latest(tmp_path).name == "step-000001"
    assert (ckpt.root(tmp_path) / "latest").read_text() == "step-000001"
    assert not ckpt.staging_dir(tmp_path, 2).exists(), "a half checkpoint was left behind"


def test_an_unwritable_checkpoint_folder_is_permission_denied(tmp_path):
    """A real chmod'ed folder. Root ignores permissions, so as root the save runs in a child
    process that drops to user nobody."""
    run = Path(os.environ.get("TMPDIR", "/tmp")) / f"forge-ckpt-perm-{os.getpid()}"
    run.mkdir(mode=0o777)
    try:
        os.chmod(run, 0o777)
        script = (
            "import sys, json; from pathlib import Path\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import test_checkpoint as t\n"
            "from forgerl.checkpoints import checkpoint as ckpt\n"
            "from forgerl.errors import CheckpointWriteError\n"
            "run = Path(sys.argv[1]); t.save(run, 1)\n"
            "ckpt.root(run).chmod(0o555)\n"
            "try:\n    t.save(run, 2)\nexcept CheckpointWriteError as e:\n    print(e)\n"
            "print('latest', ckpt.latest(run).name)\n"
        )
        command = [sys.executable, "-c", script, str(run)]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot drop to a user that permissions apply to")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
            # nobody must be able to start this Python and read the tests and the code: not
            # so in a checkout under a private folder (mktemp -d is mode 700).
            folders = [str(Path(__file__).parent), str(REPO)]
            probe = subprocess.run(
                [*command[:4], sys.executable, "-c",
                 f"import os, sys; sys.exit(any(not os.access(d, os.R_OK | os.X_OK) for d in {folders!r}))"],
                capture_output=True, text=True, cwd="/",
            )  # fmt: skip
            if probe.returncode != 0:
                pytest.skip("as root, the save would run as nobody, who cannot start this Python or read "
                            f"{folders}: {(probe.stderr.strip().splitlines() or ['no access'])[-1]}")
        env = {**os.environ, "HOME": str(run)}
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=scaled(120))
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert "permission denied" in lines[0] and "make checkpoints/ writable" in lines[0], lines
        assert lines[-1] == "latest step-000001"
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(run)], check=False)
        subprocess.run(["rm", "-rf", str(run)], check=False)


def test_resumed_metrics_drop_rows_after_the_checkpoint(tmp_path):
    rows = [{"step": i, "reward/mean": i / 10} for i in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    writer = MetricsWriter(tmp_path, resume_step=2)
    writer.write(3, {"step": 3, "reward/mean": 0.9})
    writer.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
