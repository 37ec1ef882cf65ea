"""A run directory on a bad disk, and resumes that must not lose history.

Real `forge run` processes on real file systems: a small tmpfs in a private mount namespace,
filled (ENOSPC) or remounted read-only (EROFS), so that every write of a run meets the
fault the kernel gives, not a mock of it.

* disk full during a run (after step 6's checkpoint; the test-only plugin
  tests/helpers/disk_faults.py fills it): one line saying the disk is full and how to go on,
  exit 2, no traceback, metrics.jsonl whole rows only, no temporary file left; after freeing
  space, ``--resume`` ends with every step once and the checkpointed rows unchanged;
* disk full at the start: one line, exit 2, nothing left on the disk (no run folder, no
  ``.config.yaml.tmp``);
* a read-only run directory on ``--resume``: one line, exit 2, config.yaml untouched;
* ``--resume`` when checkpoints/ was deleted: refused (one line naming ``--restart``), rows
  untouched; ``--restart`` trains from step 0 and keeps the earlier rows aside;
* ``--resume --steps 1`` on a finished 2-step run: refused, config.yaml untouched;
* metrics.jsonl with a garbled line and its last row cut mid-row: repaired on resume, the
  damaged bytes kept, one line saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ..helpers.timing import scaled
from .test_checkpoint_faults import FORGE, REPO, SMALL, _namespace_prefix, env

pytestmark = pytest.mark.integration


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def forge(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, env=env(**extra), cwd=REPO,
                          timeout=scaled(600))


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("forge: error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completed 2-step run with a checkpoint after each step; tests work on copies."""
    run = tmp_path_factory.mktemp("finished") / "run"
    proc = forge("run", *SMALL, "--steps", "2", "--output", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target, symlinks=True)
    return target


# ----------------------------------------------------------------------------- item 3


def test_a_full_disk_during_a_run_is_one_line_with_whole_rows_and_resume_completes(tmp_path: Path):
    prefix = _namespace_prefix()
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = disk / "run"
    cmd = " ".join(FORGE)
    # A checkpoint at steps 6 and 12 only: once the disk is filled after step 6, the rows of
    # steps 7-11 (about 1 KB each) must outgrow the last free bytes of metrics.jsonl's page,
    # so a row write is what meets the full disk (not only the checkpoint, tested elsewhere).
    args = " ".join(f"'{a}'" for a in [*SMALL, "--steps", "12", "--set", "checkpoint.every=6", "--output", str(run)])
    script = f"""
        set -u
        mount -t tmpfs -o size=64m tmpfs '{disk}'
        {cmd} run {args} > '{out}/out1' 2> '{out}/err1'; echo $? > '{out}/rc1'
        cp '{run}/metrics.jsonl' '{out}/metrics1.jsonl'
        ls -A '{run}' '{run}/checkpoints' '{run}/logs' > '{out}/ls1'
        rm '{run}/checkpoints/filler'   # the user frees space
        FORGE_TEST_DISK_FAULT= {cmd} run --resume '{run}' > '{out}/out2' 2> '{out}/err2'; echo $? > '{out}/rc2'
        cp '{run}/metrics.jsonl' '{out}/metrics2.jsonl'
    """
    subprocess.run([*prefix, "bash", "-c", script], env=env(FORGE_TEST_DISK_FAULT="fill:6"), cwd=REPO,
                   timeout=scaled(900), check=True)
    read = lambda name: (out / name).read_text()  # noqa: E731
    err1 = read("err1")
    assert read("rc1").strip() == "2", err1[-3000:]
    assert "Traceback" not in err1, err1[-3000:]
    said = [line for line in err1.splitlines() if line.startswith("forge: error: ")]
    assert len(said) == 1, err1[-3000:]
    assert "is full" in said[0] and f"forge run --resume {run}" in said[0] and "free space" in said[0], said

    raw = (out / "metrics1.jsonl").read_bytes()
    assert raw.endswith(b"\n"), raw[-200:]
    rows = [json.loads(line) for line in raw.decode().splitlines()]  # whole rows only: every line parses
    got = [r["step"] for r in rows]
    assert got == list(range(1, len(got) + 1)) and 6 <= len(got) < 12, got
    assert not [n for n in read("ls1").split() if n.startswith(".") or n.endswith(".tmp")], read("ls1")

    assert read("rc2").strip() == "0", read("err2")[-3000:]
    resumed = [json.loads(line) for line in read("metrics2.jsonl").splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(resumed[:6], rows[:6]):  # the checkpointed rows are the ones written before
        assert deterministic(a) == deterministic(b), a["step"]


def test_a_full_disk_at_the_start_is_one_line_and_leaves_nothing_behind(tmp_path: Path):
    prefix = _namespace_prefix()
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    cmd = " ".join(FORGE)
    args = " ".join(f"'{a}'" for a in [*SMALL, "--steps", "1", "--output", str(disk / "runs" / "a")])
    script = f"""
        set -u
        mount -t tmpfs -o size=1m tmpfs '{disk}'
        dd if=/dev/zero of='{disk}/filler' bs=64k 2> /dev/null || true
        {cmd} run {args} > '{out}/out' 2> '{out}/err'; echo $? > '{out}/rc'
        ls -A '{disk}' > '{out}/ls'
    """
    subprocess.run([*prefix, "bash", "-c", script], env=env(), cwd=REPO, timeout=scaled(300), check=True)
    proc = subprocess.CompletedProcess([], int((out / "rc").read_text()), (out / "out").read_text(),
                                       (out / "err").read_text())
    line = one_error_line(proc)
    assert f"cannot write {disk / 'runs' / 'a' / 'config.yaml'}: no space left on device; free space" in line, line
    assert (out / "ls").read_text().split() == ["filler"], "a failed start must leave nothing on the disk"


def test_a_read_only_run_directory_on_resume_is_one_line(finished_run: Path, tmp_path: Path):
    prefix = _namespace_prefix()
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = disk / "run"
    cmd = " ".join(FORGE)
    script = f"""
        set -u
        mount -t tmpfs -o size=64m tmpfs '{disk}'
        cp -a '{finished_run}' '{run}'
        mount -o remount,ro '{disk}'
        {cmd} run --resume '{run}' --steps 3 > '{out}/out' 2> '{out}/err'; echo $? > '{out}/rc'
        cp '{run}/config.yaml' '{out}/config.yaml'
    """
    subprocess.run([*prefix, "bash", "-c", script], env=env(), cwd=REPO, timeout=scaled(300), check=True)
    proc = subprocess.CompletedProcess([], int((out / "rc").read_text()), (out / "out").read_text(),
                                       (out / "err").read_text())
    line = one_error_line(proc)
    assert f"cannot write {run / 'config.yaml'}: read-only file system" in line, line
    assert f"make the file system of {run}/ writable" in line, line
    assert (out / "config.yaml").read_bytes() == (finished_run / "config.yaml").read_bytes()


# ----------------------------------------------------------------------------- item 4


def test_resume_without_checkpoints_is_refused_and_restart_keeps_the_finished_rows(
    finished_run: Path, tmp_path: Path
):
    run = copy_of(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    before = (run / "metrics.jsonl").read_bytes()

    line = one_error_line(forge("run", "--resume", str(run)))
    assert "no checkpoint to resume from" in line and "2 finished steps" in line, line
    assert f"forge run --restart {run}" in line, line
    assert (run / "metrics.jsonl").read_bytes() == before, "a refused resume must not touch the rows"

    again = forge("run", "--restart", str(run))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "kept in metrics.before-restart-1.jsonl" in again.stderr, again.stderr[-3000:]
    assert (run / "metrics.before-restart-1.jsonl").read_bytes() == before
    assert [r["step"] for r in metrics(run)] == [1, 2]

    line = one_error_line(forge("run", "--restart", str(run)))  # it has checkpoints again now
    assert f"forge run --resume {run}" in line, line


def test_resume_with_fewer_steps_than_trained_is_refused_and_config_kept(finished_run: Path, tmp_path: Path):
    run = copy_of(finished_run, tmp_path)
    config = (run / "config.yaml").read_bytes()
    line = one_error_line(forge("run", "--resume", str(run), "--steps", "1"))
    assert "loop.steps 1 is below the 2 steps" in line and "--steps 2 or more" in line, line
    assert (run / "config.yaml").read_bytes() == config


def test_resume_repairs_a_garbled_and_torn_metrics_file(finished_run: Path, tmp_path: Path):
    run = copy_of(finished_run, tmp_path)
    first, second = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    garbage = bytes(range(128, 256)) + b"\x00\x01"
    torn = second[: len(second) // 2]  # the last row cut mid-row, as a power cut leaves it
    (run / "metrics.jsonl").write_bytes(first + garbage + b"\n" + torn)

    proc = forge("run", "--resume", str(run), "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "metrics.jsonl repaired" in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert "2 damaged lines" in said[0] and "metrics.jsonl.damaged" in said[0], said
    assert "no row is left for step 2" in said[0], said
    assert (run / "metrics.jsonl.damaged").read_bytes() == garbage + b"\n" + torn + b"\n"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 3]
    assert rows[0] == json.loads(first)


def test_resume_and_restart_together_are_refused(finished_run: Path):
    line = one_error_line(forge("run", "--resume", str(finished_run), "--restart", str(finished_run)))
    assert "--resume" in line and "--restart" in line and "not both" in line, line
