"""metrics.jsonl keeps whole rows: a write the disk refuses part-way leaves no torn row, and
a damaged file is repaired on resume with what was dropped kept aside."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forgerl.runloop.metrics import DAMAGED_FILE, MetricsWriter, repair, set_aside


def row(step: int, pad: int = 40) -> bytes:
    return (json.dumps({"step": step, "reward/mean": step / 10, "pad": "x" * pad}) + "\n").encode()


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_row_the_disk_refuses_part_way_is_cut_back_and_named_in_one_line(tmp_path: Path):
    # A real short write: RLIMIT_FSIZE makes the kernel take only the bytes up to the limit
    # (then EFBIG), as a full disk takes only what fits. Run in a child: the limit is per process.
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from forgerl.errors import RunWriteError
        from forgerl.runloop.metrics import MetricsWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        run = Path({str(tmp_path)!r})
        w = MetricsWriter(run)
        w.append({{"step": 1, "pad": "x" * 100}})
        size = (run / "metrics.jsonl").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 300, size + 300))
        try:
            w.append({{"step": 2, "pad": "y" * 2000}})
        except RunWriteError as exc:
            print("ERROR", exc)
        w.close()
        w.close()
        print("SIZE", size)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "ERROR" in said, out.stdout
    assert said["ERROR"].startswith(f"cannot write {tmp_path / 'metrics.jsonl'}: file too large"), said
    assert "forge run --resume" in said["ERROR"] and "\n" not in said["ERROR"]
    data = (tmp_path / "metrics.jsonl").read_bytes()
    assert len(data) == int(said["SIZE"]), "the torn part of row 2 must be cut off"
    assert steps(tmp_path / "metrics.jsonl") == [1]


def test_repair_sets_aside_torn_and_undecodable_lines_and_names_the_lost_step(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    garbage = b"\xff\xfe\x00binary\x9c"
    torn = row(3)[:25]
    path.write_bytes(row(1) + garbage + b"\n" + row(2) + b"not json\n" + torn)
    notes = repair(path, 3)
    assert steps(path) == [1, 2]
    assert (tmp_path / DAMAGED_FILE).read_bytes() == garbage + b"\n" + b"not json\n" + torn + b"\n"
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert "3 damaged lines" in notes[0] and DAMAGED_FILE in notes[0], notes
    assert "no row is left for step 3" in notes[0], notes


def test_repair_drops_rows_past_the_checkpoint_silently_and_leaves_a_clean_file_alone(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row(1) + row(2) + row(3))
    before = path.stat().st_mtime_ns
    assert repair(path, 3) == [] and path.stat().st_mtime_ns == before
    assert repair(path, 2) == []  # step 3 is redone by the resumed run: nothing lost
    assert steps(path) == [1, 2]
    assert not (tmp_path / DAMAGED_FILE).exists()


def test_a_resumed_writer_repairs_then_appends_whole_rows(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row(1) + b"\x80\x81\n" + row(2)[:-10])  # the step-2 row cut mid-row
    w = MetricsWriter(tmp_path, resume_step=2)
    w.append({"step": 3})
    w.close()
    assert steps(path) == [1, 3]
    assert (tmp_path / DAMAGED_FILE).read_bytes() == b"\x80\x81\n" + row(2)[:-10] + b"\n"


def test_a_fresh_start_sets_earlier_rows_aside_instead_of_deleting_them(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row(1) + row(2))
    notes = set_aside(tmp_path)
    assert not path.exists()
    assert (tmp_path / "metrics.before-restart-1.jsonl").read_bytes() == row(1) + row(2)
    assert "2 earlier rows" in notes[0] and "metrics.before-restart-1.jsonl" in notes[0], notes
    path.write_bytes(row(1))
    w = MetricsWriter(tmp_path)  # a run starting at step 0 again: the same, never a delete
    w.close()
    assert (tmp_path / "metrics.before-restart-2.jsonl").read_bytes() == row(1)
    assert path.read_bytes() == b""


@pytest.mark.parametrize("content", [b"", None])
def test_nothing_to_set_aside(tmp_path: Path, content: bytes | None):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_bytes(content)
    assert set_aside(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []
