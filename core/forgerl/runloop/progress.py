"""Following a run from ``forge run``: what it is doing from the first second, its steps,
then a summary.

Two files of the run directory are followed: events.jsonl (:mod:`forgerl.events`: model
preparation, servers starting and their logs, health waits, the first evaluation) and
metrics.jsonl (one row per step). In a terminal, events are lines above a step bar showing
reward, accuracy when measured, seconds per step and ETA; without one (CI, nohup, Slurm),
every event and every step is one line, so a log shows the run advancing. Works for every
scheduler whose run directory is visible here; this side only reads.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from forgerl.events import EVENTS_FILE, events_size, read_events
from forgerl.interfaces import Scheduler
from forgerl.rundirs import runs
from forgerl.types import JobHandle, JobSpec, JobStatus

#: Without a terminal, a phase that runs this long without news gets a "still ..." line.
HEARTBEAT_S = 30.0


class _Rows:
    """metrics.jsonl, read on: complete new rows each call. A resumed run rewrites the file
    shorter (rows past its checkpoint dropped): reading starts over, and rows already seen
    (by step) are not reported again."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.last_step = max((r["step"] for r in self._read()), default=0)

    def _read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset = 0
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        return rows

    def new(self) -> list[dict[str, Any]]:
        rows = [r for r in self._read() if r["step"] > self.last_step]
        if rows:
            self.last_step = rows[-1]["step"]
        return rows


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def step_text(rows: list[dict[str, Any]], total: int, accuracy: float | None) -> str:
    """``step 3/10  reward 0.812  accuracy 0.400  2.13 s/step  ETA 0:15`` for the newest row;
    seconds per step over the last (up to) ten steps, evaluation and checkpoints included."""
    row = rows[-1]
    parts = [f"step {row['step']}/{total}"]
    reward = row.get("reward/mean")
    if isinstance(reward, (int, float)):
        parts.append(f"reward {reward:.3f}")
    elif isinstance(row.get("loss/sft"), (int, float)):  # a supervised run has a loss, no reward
        parts.append(f"loss {row['loss/sft']:.3f}")
    if accuracy is not None:
        parts.append(f"accuracy {accuracy:.3f}")
    per_step = seconds_per_step(rows[-11:])
    if per_step is not None:
        parts.append(f"{per_step:.2f} s/step")
        parts.append(f"ETA {_clock(per_step * max(0, total - row['step']))}")
    return "  ".join(parts)


def seconds_per_step(rows: list[dict[str, Any]]) -> float | None:
    walls = [(r["step"], r["time/wall"]) for r in rows if isinstance(r.get("time/wall"), (int, float))]
    if len(walls) >= 2 and walls[-1][0] > walls[0][0]:
        return (walls[-1][1] - walls[0][1]) / (walls[-1][0] - walls[0][0])
    last = rows[-1].get("time/step") if rows else None
    return float(last) if isinstance(last, (int, float)) else None


def event_text(event: dict[str, Any], elapsed: float) -> str:
    """``[0:05] trainer-0: preparing model tiny (usually ~5 s; log: ...)``."""
    who = event.get("who", "?")
    text = f"[{_clock(elapsed)}] {who}: {event.get('message', '')}"
    if event.get("state") in ("done", "failed") and isinstance(event.get("took_s"), (int, float)):
        text += f" in {event['took_s']:.1f} s"
    notes = []
    if event.get("state") == "start" and event.get("detail"):
        notes.append(str(event["detail"]))
    if event.get("state") == "start" and isinstance(event.get("typical_s"), (int, float)) and event["typical_s"] >= 2:
        notes.append(f"last time {event['typical_s']:.0f} s")
    if event.get("log"):
        notes.append(f"log: {event['log']}")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _ends_in(event: dict[str, Any], later: list[dict[str, Any]]) -> bool:
    if event.get("state") != "start":
        return False
    same = (event.get("who"), event.get("stage"))
    return any((e.get("who"), e.get("stage")) == same and e.get("state") in ("done", "failed") for e in later)


class RunFollower(threading.Thread):
    """Prints a run's events and steps until stopped. ``mode``: ``bar`` (a terminal),
    ``lines`` (anything else) or ``off``."""

    def __init__(self, run_dir: Path, total: int, mode: str = "lines", out: IO[str] | None = None,
                 poll_s: float = 0.5, events_from: int | None = None):
        super().__init__(daemon=True, name="forge-progress")
        self.run_dir = run_dir
        self.total = total
        self.mode = mode
        self.out = out or sys.stderr
        self.poll_s = poll_s
        self.stop_event = threading.Event()
        self.started = time.monotonic()
        self.rows = _Rows(run_dir / runs.METRICS_FILE)
        self.events_path = run_dir / EVENTS_FILE
        # Events of an earlier job in this directory (a resumed run) are history, not news.
        self.events_offset = events_size(run_dir) if events_from is None else events_from
        self.recent: list[dict[str, Any]] = []
        self.accuracy: float | None = None
        self.open_phases: dict[tuple[str, str], tuple[dict[str, Any], float]] = {}
        self.last_said = time.monotonic()
        self.bar: Any = None

    def say(self, text: str) -> None:
        self.last_said = time.monotonic()
        if self.bar is not None:
            self.bar.write(f"forge: {text}", file=self.out)
        else:
            print(f"forge: {text}", file=self.out, flush=True)

    def run(self) -> None:
        if self.mode == "off":
            self.stop_event.wait()
            return
        while True:
            stopping = self.stop_event.wait(self.poll_s)
            self.poll()
            if stopping:
                break
        if self.bar is not None:
            self.bar.close()

    def poll(self) -> None:
        events, self.events_offset = read_events(self.events_path, self.events_offset)
        for i, event in enumerate(events):
            self._event(event, quick=_ends_in(event, events[i + 1:]))
        rows = self.rows.new()
        for row in rows:
            self._row(row)
        if self.mode == "lines" and time.monotonic() - self.last_said > HEARTBEAT_S and self.open_phases:
            event, since = min(self.open_phases.values(), key=lambda v: v[1])
            self.say(f"[{_clock(time.monotonic() - self.started)}] {event.get('who', '?')}: still "
                     f"{event.get('message', '')} ({_clock(time.monotonic() - since)} so far)")

    def _event(self, event: dict[str, Any], quick: bool = False) -> None:
        """``quick``: a start whose end came in the same read, which says it all."""
        key = (str(event.get("who")), str(event.get("stage")))
        if event.get("state") == "start":
            self.open_phases[key] = (event, time.monotonic())
        else:
            self.open_phases.pop(key, None)
        if event.get("stage") == "loop" and event.get("state") == "start":
            self.open_phases.clear()
        if not quick:
            self.say(event_text(event, time.monotonic() - self.started))
        if event.get("stage") == "loop" and self.mode == "bar":
            self._open_bar(int(event.get("step", 0)))

    def _open_bar(self, step: int) -> None:
        if self.bar is not None:
            return
        from tqdm import tqdm

        # The text is tqdm's desc, not its postfix (which tqdm prefixes with ", ").
        self.bar = tqdm(total=self.total, initial=step, unit="step", file=self.out,
                        bar_format="forge {percentage:3.0f}%|{bar:20}| {desc}")
        self.bar.set_description_str(f"step {step}/{self.total}")

    def _row(self, row: dict[str, Any]) -> None:
        self.recent = [*self.recent[-10:], row]
        if isinstance(row.get("eval/accuracy"), (int, float)):
            self.accuracy = float(row["eval/accuracy"])
        text = step_text(self.recent, self.total, self.accuracy)
        if self.mode == "bar":
            self._open_bar(row["step"] - 1)
            self.bar.n = min(int(row["step"]), self.total)
            self.bar.set_description_str(text, refresh=False)
            self.bar.refresh()
        else:
            self.say(text)


def job_text(job: JobSpec) -> str:
    """``trainer (2 ranks), vllm (2 replicas)``."""
    parts = []
    for role in job.roles:
        counts = []
        if role.replicas != 1:
            counts.append(f"{role.replicas} replicas")
        if role.ranks_per_replica != 1:
            counts.append(f"{role.ranks_per_replica} ranks" + (" each" if role.replicas != 1 else ""))
        parts.append(role.name + (f" ({', '.join(counts)})" if counts else ""))
    return ", ".join(parts)


def follow_run(
    scheduler: Scheduler, handle: JobHandle, run_dir: Path, config: Any, progress: bool = True,
    events_from: int | None = None,
) -> JobStatus:
    """Wait for the job, showing its progress from ``events_from`` in events.jsonl (its size
    before the job was submitted); print the run's summary; return its status."""
    mode = "off" if not progress else "bar" if sys.stderr.isatty() else "lines"
    follower = RunFollower(run_dir, int(config.loop.steps), mode=mode, events_from=events_from)
    follower.start()
    try:
        status = scheduler.wait(handle)
    finally:
        follower.stop_event.set()
        follower.join(timeout=5)
    print_summary(run_dir, status)
    return status


def print_summary(run_dir: Path, status: JobStatus) -> None:
    out = sys.stderr
    try:
        summary = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        summary = None
    print(f"forge: run {status.state.value}" + (f" (exit {status.exit_code})" if status.exit_code else ""), file=out)
    if status.detail:
        print(f"forge: {status.detail}", file=out)
    full = disk_full_note(run_dir) if status.state.value == "failed" else None
    if full:
        print(f"forge: error: {full}", file=out)
    if summary and summary.get("objective") == "eval":
        _print_eval(summary, out)
    elif summary:
        before, after = summary.get("eval_accuracy_start"), summary.get("eval_accuracy_end")
        if before is not None or after is not None:
            print(f"  held-out accuracy: {_fmt(before)} -> {_fmt(after)}", file=out)
        if "steps" in summary and summary.get("objective") == "sft":
            kept = summary.get("demonstrations") or {}
            print(f"  steps: {summary['steps']}   demonstrations: " + ", ".join(f"{v} {k.replace('_', ' ')}"
                  for k, v in kept.items()), file=out)  # fmt: skip
        elif "steps" in summary:
            print(f"  steps: {summary['steps']}   policy version: {summary.get('policy_version')}", file=out)
        phases = {k: v for k, v in summary.get("time", {}).items() if v or summary.get("objective") != "sft"}
        if phases:
            print("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), file=out)
    print(f"  run directory: {run_dir}", file=out)
    print(f"  {'table' if summary and summary.get('objective') == 'eval' else 'plots'}: forge report {run_dir}",
          file=out)  # fmt: skip


def _print_eval(summary: dict[str, Any], out: Any) -> None:
    """The lines of a finished ``forge eval`` (its eval_summary.json has the intervals)."""
    ev = summary.get("eval") or {}
    k = ev.get("k")
    scores = [(f"mean@{k}", ev.get(f"mean@{k}") or {}), *sorted((ev.get("pass") or {}).items(),
              key=lambda kv: int(kv[0].split("@")[1]))]  # fmt: skip
    print(f"  {ev.get('problems')} problems x {k} samples ({ev.get('samples')} scored): " + ", ".join(
        f"{name} {_fmt(v.get('mean'))}" for name, v in scores), file=out)  # fmt: skip
    print(f"  results: {summary.get('run_dir')}/eval_samples.jsonl, eval_summary.json", file=out)


#: Free bytes below which a run directory's disk counts as full: less than a metrics row and
#: a log line, so a failed run on it most likely failed for that.
FULL_BELOW = 64 * 1024


def disk_full_note(run_dir: Path) -> str | None:
    """What to do when the disk under ``run_dir`` is full. A process that fails there may
    not even get its one error line into its log, so forge says it from outside."""
    import shutil

    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free >= FULL_BELOW:
        return None
    return (f"the disk holding {run_dir} is full ({free} bytes free): free space, then continue with "
            f"`forge run --resume {run_dir}`")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
