"""Checkpoints under attack and on a bad disk, in real runs and a real trainer.

* a tampered trainer checkpoint (pickle bomb in DCP's metadata or in a stored value) is
  refused with one line naming the file, and no code from it runs;
* a full file system (a small tmpfs in a private mount namespace) and a read-only folder
  (chmod, as a user that permissions bind) while checkpointing: the run writes the step's
  metrics, stops with one line (path, cause, what to do), exit 2, the previous checkpoint
  stays the latest; after fixing the disk, ``forge run --resume`` redoes the step exactly;
* a corrupted latest checkpoint: resume falls back to the previous one, says so, and ends
  with the same metrics as the run before;
* two ``forge run`` into one output directory: the second is refused, exit 2, one line.

The disk faults land between two checkpoints through the test-only plugin
tests/helpers/disk_faults.py (its hook runs after a step, before the next one).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forgerl.cli"]
SMALL = [
    "--model", "tiny",
    "--generator", "hf",
    "--trainer", "fsdp",
    "--reward", "format",
    "--set", "rewards.0.options.pattern=\\d",
    "--set", "loop.prompts_per_step=2",
    "--set", "loop.group_size=4",
    "--set", "loop.sampling.max_tokens=12",
    "--set", "loop.eval_size=4",
    "--set", "trainer.options.lr=1e-3",
    "--set", "checkpoint.every=1",
    "--set", "checkpoint.keep=2",
]


def env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "FORGE_PLUGINS": "tests.helpers.disk_faults",
        **extra,
    }


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert deterministic(x) == pytest.approx(deterministic(y), rel=1e-6, abs=1e-7), x["step"]


def error_line(stderr: str, run: Path) -> str:
    """The run's error: the CLI shows the start of it (naming the rank's log), the rank's
    log holds all of it."""
    shown = [line for line in stderr.splitlines() if "not written" in line]
    assert shown and "rank 0 exited with code 2" in shown[0], stderr[-3000:]
    log = (run / "logs" / "trainer-0.log").read_text().splitlines()
    full = [line for line in log if line.startswith("forge: error: checkpoint of step")]
    assert len(full) == 1, log[-20:]
    return full[0]


# ------------------------------------------------------------------------- tampering


def bomb(marker: Path) -> bytes:
    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Bomb())


def test_a_tampered_trainer_checkpoint_is_refused_and_runs_nothing(tiny_model_dir: Path, tmp_path: Path):
    import torch

    from forgerl.errors import CheckpointUnusable

    from ..helpers import trainer_worker as worker

    marker = tmp_path / "MARKER"
    trainer = worker.make_trainer(tiny_model_dir, tmp_path, micro_batch_size=2)
    try:
        trainer.train_step(worker.on_policy(trainer, worker.make_batch(tiny_model_dir, rows=3, seed=4)))
        good = tmp_path / "good"
        trainer.save(good)

        # 1. DCP's .metadata replaced by a pickle whose __reduce__ runs a command.
        bad = tmp_path / "bad-metadata"
        shutil.copytree(good, bad)
        (bad / ".metadata").write_bytes(bomb(marker))
        with pytest.raises(CheckpointUnusable) as info:
            trainer.load(bad)
        assert str(bad / ".metadata") in str(info.value) and "\n" not in str(info.value)

        # 2. Genuine metadata, but a stored value (the learning rate) swapped for a torch.save'd
        #    bomb: DCP's own planner would torch.load it with weights_only=False.
        bad = tmp_path / "bad-value"
        shutil.copytree(good, bad)
        with open(bad / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # our own file: fine to unpickle in the test
        evil = bad / "__evil.distcp"
        torch.save(_TorchBomb(marker), evil)
        for index, info_ in metadata.storage_data.items():
            if index.fqn == "optimizer.param_groups.0.lr":
                metadata.storage_data[index] = type(info_)(
                    relative_path=evil.name, offset=0, length=evil.stat().st_size
                )
        (bad / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(CheckpointUnusable, match="optimizer.param_groups.0.lr"):
            trainer.load(bad)

        trainer.load(good)  # the genuine one still loads
    finally:
        trainer.close()
    assert not marker.exists(), "loading a tampered checkpoint ran code from it"


class _TorchBomb:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------------- disk faults


def _namespace_prefix() -> list[str]:
    """unshare arguments for a private mount namespace in which this user may mount a tmpfs."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private mount namespace with a small tmpfs")
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--mount", "--user", "--map-root-user"]
    where = tempfile.mkdtemp(prefix="forge-ns-probe-")
    try:
        probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where],
                               capture_output=True, text=True)
    finally:
        os.rmdir(where)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stdout.strip() or probe.stderr.strip()}")
    return prefix


def test_a_full_disk_stops_the_run_keeps_the_previous_checkpoint_and_resume_redoes_the_step(tmp_path: Path):
    prefix = _namespace_prefix()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    forge = " ".join(FORGE)
    args = " ".join(f"'{a}'" for a in [*SMALL, "--steps", "3", "--output", str(run)])
    # The tmpfs lives only in this namespace: the whole scenario runs inside it.
    script = f"""
        set -u
        mount -t tmpfs -o size=256m tmpfs '{run}/checkpoints'
        {forge} run {args} > '{tmp_path}/out1' 2> '{tmp_path}/err1'; echo $? > '{tmp_path}/rc1'
        cp '{run}/metrics.jsonl' '{tmp_path}/metrics1.jsonl'
        cat '{run}/checkpoints/latest' > '{tmp_path}/latest1'; ls -A '{run}/checkpoints' > '{tmp_path}/ls1'
        rm '{run}/checkpoints/filler'   # the user frees space
        FORGE_TEST_DISK_FAULT= {forge} run --resume '{run}' > '{tmp_path}/out2' 2> '{tmp_path}/err2'; echo $? > '{tmp_path}/rc2'
        cp -a '{run}/checkpoints' '{tmp_path}/checkpoints-after'
    """
    subprocess.run([*prefix, "bash", "-c", script], env=env(FORGE_TEST_DISK_FAULT="fill:1"), cwd=REPO,
                   timeout=scaled(900), check=True)
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731
    assert read("rc1").strip() == "2", read("err1")[-3000:]
    line = error_line(read("err1"), run)
    assert "no space left on device" in line and "step-000001 is intact" in line, line
    assert f"forge run --resume {run}" in line and "free space" in line, line
    assert read("latest1").strip() == "step-000001"
    assert not [n for n in read("ls1").split() if n.startswith(".tmp")], read("ls1")
    failed_rows = [json.loads(line) for line in read("metrics1.jsonl").splitlines()]
    assert [r["step"] for r in failed_rows] == [1, 2], "the failing step's metrics must be written"

    assert read("rc2").strip() == "0", read("err2")[-3000:]
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    same_rows(resumed[:2], failed_rows)  # step 2 redone from step 1's checkpoint: the same numbers
    assert (tmp_path / "checkpoints-after" / "latest").read_text() == "step-000003"


def test_a_read_only_checkpoint_folder_stops_the_run_with_permission_denied(tmp_path: Path):
    # Permissions bind only users other than root: as root, run forge as nobody, in a
    # folder nobody can use (pytest's tmp_path is private to root).
    base = Path(tempfile.mkdtemp(prefix="forge-ro-"))
    try:
        base.chmod(0o777)
        run = base / "run"
        prefix: list[str] = []
        extra = {}
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot run forge as a user permissions bind")
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            probe = subprocess.run(
                [*prefix, sys.executable, "-c", f"import subprocess; subprocess.run([{sys.executable!r}, '-V'], check=True)"],
                capture_output=True, text=True, cwd=base,
            )
            if probe.returncode != 0:  # e.g. the interpreter lives under /root (mode 700)
                pytest.skip("as root, forge would run as nobody, who cannot start this Python: "
                            f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
            extra = {"HOME": str(base)}  # the tiny model is built there
        first = subprocess.run([*prefix, *FORGE, "run", *SMALL, "--steps", "3", "--output", str(run)],
                               capture_output=True, text=True, env=env(FORGE_TEST_DISK_FAULT="chmod:1", **extra),
                               cwd=REPO, timeout=scaled(600))
        assert first.returncode == 2, first.stderr[-3000:]
        line = error_line(first.stderr, run)
        assert "permission denied" in line and "step-000001 is intact" in line, line
        assert "make checkpoints/ writable" in line, line
        assert (run / "checkpoints" / "latest").read_text() == "step-000001"
        assert [r["step"] for r in metrics(run)] == [1, 2]

        (run / "checkpoints").chmod(0o755)  # the user fixes the folder
        again = subprocess.run([*prefix, *FORGE, "run", "--resume", str(run)], capture_output=True, text=True,
                               env=env(**extra), cwd=REPO, timeout=scaled(600))
        assert again.returncode == 0, again.stderr[-3000:]
        assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------- fallback


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path):
    run = tmp_path / "run"
    first = subprocess.run([*FORGE, "run", *SMALL, "--steps", "3", "--output", str(run)],
                           capture_output=True, text=True, env=env(), cwd=REPO, timeout=scaled(600))
    assert first.returncode == 0, first.stderr[-3000:]
    before = metrics(run)
    latest = run / "checkpoints" / "step-000003"
    data = next((latest / "trainer").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a torn trainer file

    again = subprocess.run([*FORGE, "run", "--resume", str(run)], capture_output=True, text=True, env=env(),
                           cwd=REPO, timeout=scaled(600))
    assert again.returncode == 0, again.stderr[-3000:]
    log = (run / "logs" / "trainer-0.log").read_text()
    warning = next((line for line in log.splitlines() if "is unusable" in line), "")
    assert str(latest) in warning and "resuming from step-000002 instead" in warning, log[-3000:]
    same_rows(metrics(run), before)


# ------------------------------------------------------------------------- one run per folder


def test_a_second_run_into_the_same_output_is_refused(tmp_path: Path):
    run = tmp_path / "run"
    first = subprocess.Popen([*FORGE, "run", *SMALL, "--steps", "2", "--output", str(run)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    try:
        wait_until(lambda: (run / "job.json").is_file(), 120, "the first run to start its job")
        for args in (["run", *SMALL, "--steps", "2", "--output", str(run)], ["run", "--resume", str(run)]):
            second = subprocess.run([*FORGE, *args], capture_output=True, text=True, env=env(), cwd=REPO,
                                    timeout=scaled(120))
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            assert lines[0].startswith("forge: error:") and str(run) in lines[0], lines
            assert "already holds a run" in lines[0] or "in use by a running local job" in lines[0], lines
        assert first.wait(timeout=scaled(300)) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [r["step"] for r in metrics(run)] == [1, 2], "the refused runs must not disturb the first"
