"""Progress of a run as `forge run` shows it: events from every process of the run
(forgerl.events) and one line per step, read from the run directory."""

from __future__ import annotations

import io
import json
import multiprocessing
from pathlib import Path

import pytest

from forgerl import events
from forgerl.events import EVENTS_FILE, announce, phase, read_events
from forgerl.runloop import progress
from forgerl.runloop.progress import RunFollower, step_text


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    # Remembered phase durations go to the model cache folder: a private one per test.
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FORGE_RUN_DIR", raising=False)
    monkeypatch.setenv("FORGE_ROLE", "trainer")
    monkeypatch.setenv("FORGE_REPLICA", "0")


def follower(run_dir: Path, total: int = 4, mode: str = "lines") -> tuple[RunFollower, io.StringIO]:
    out = io.StringIO()
    return RunFollower(run_dir, total, mode=mode, out=out), out


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def write_row(run_dir: Path, step: int, wall: float, **extra) -> None:
    row = {"step": step, "time/wall": wall, "time/step": 0.5, "reward/mean": step / 10, **extra}
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def test_events_then_one_line_per_step(tmp_path):
    f, out = follower(tmp_path)
    with phase("preparing model tiny", stage="model", key="model:tiny", run_dir=tmp_path, detail="first use only"):
        pass
    f.poll()
    # A phase that started and ended between two reads is one line.
    assert len(lines(out)) == 1 and "trainer-0: preparing model tiny: done in" in lines(out)[0]

    slow = phase("starting the server", stage="server", run_dir=tmp_path, log=tmp_path / "logs" / "vllm-0.log")
    f.poll()
    assert "trainer-0: starting the server" in lines(out)[-1] and "log: " in lines(out)[-1]
    slow.done()
    announce("training: steps 1 to 4", stage="loop", state="start", run_dir=tmp_path, step=0, steps=4)
    write_row(tmp_path, 1, 100.0)
    write_row(tmp_path, 2, 102.0, **{"eval/accuracy": 0.25})
    f.poll()
    write_row(tmp_path, 3, 104.0)
    f.poll()
    text = lines(out)
    assert text[-5].endswith("starting the server: done in 0.0 s")
    assert text[-4].endswith("training: steps 1 to 4")
    assert text[-3] == "forge: step 1/4  reward 0.100  0.50 s/step  ETA 0:01"
    assert text[-2] == "forge: step 2/4  reward 0.200  accuracy 0.250  2.00 s/step  ETA 0:04"
    # The last measured accuracy stays until the next evaluation.
    assert text[-1] == "forge: step 3/4  reward 0.300  accuracy 0.250  2.00 s/step  ETA 0:02"


def test_a_phase_remembers_how_long_it_took(tmp_path):
    with phase("preparing model", stage="model", key="model:x", run_dir=tmp_path):
        pass
    events._remember("model:x", 42.0)  # as if it had taken that long
    f, out = follower(tmp_path)
    phase("preparing model", stage="model", key="model:x", run_dir=tmp_path)
    f.poll()
    assert "(last time 42 s)" in lines(out)[-1]


def test_a_failing_phase_says_so_and_raises(tmp_path):
    f, out = follower(tmp_path)
    with pytest.raises(RuntimeError), phase("building trainer", stage="trainer", run_dir=tmp_path):
        raise RuntimeError("no memory")
    f.poll()
    assert "building trainer: failed (no memory) in" in lines(out)[-1]


def test_a_torn_line_waits_and_an_earlier_jobs_history_is_not_news(tmp_path):
    announce("from the job before a resume", run_dir=tmp_path)
    write_row(tmp_path, 1, 100.0)
    write_row(tmp_path, 2, 101.0)
    f, out = follower(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "reward/mean": 0.')
    f.poll()
    assert lines(out) == []
    # The resumed run drops rows past its checkpoint (the file gets shorter), then goes on.
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/wall": 100.0}) + "\n")
    f.poll()
    write_row(tmp_path, 2, 110.0)
    write_row(tmp_path, 3, 111.0)
    f.poll()
    assert [ln.split("  ")[0] for ln in lines(out)] == ["forge: step 3/4"]


def test_still_waiting_line_without_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.0)
    f, out = follower(tmp_path)
    phase("starting the server", stage="server", run_dir=tmp_path)
    f.poll()
    f.poll()
    assert "trainer-0: still starting the server (0:00 so far)" in lines(out)[-1]


def test_the_terminal_bar_shows_step_reward_accuracy_and_eta(tmp_path):
    f, out = follower(tmp_path, mode="bar")
    phase("preparing model", stage="model", run_dir=tmp_path)
    f.poll()
    announce("training", stage="loop", state="start", run_dir=tmp_path, step=0, steps=4)
    write_row(tmp_path, 1, 100.0)
    write_row(tmp_path, 2, 101.0, **{"eval/accuracy": 0.5})
    f.poll()
    f.bar.close()
    text = out.getvalue()
    assert "forge: [0:00] trainer-0: preparing model" in text
    assert "step 2/4  reward 0.200  accuracy 0.500  1.00 s/step  ETA 0:02" in text


def test_step_text_without_wall_times_uses_the_step_time():
    assert step_text([{"step": 1, "time/step": 3.0}], 5, None) == "step 1/5  3.00 s/step  ETA 0:12"


def _append_many(run_dir: str, who: int) -> None:
    for i in range(200):
        announce(f"process {who} event {i} " + "x" * 200, run_dir=run_dir)


def test_events_of_several_processes_never_mix(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got, offset = read_events(tmp_path / EVENTS_FILE)
    assert len(got) == 800 and offset == (tmp_path / EVENTS_FILE).stat().st_size


def test_without_a_run_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    announce("nowhere to go")
    with phase("nothing", stage="x"):
        pass
    assert not (tmp_path / EVENTS_FILE).exists()
