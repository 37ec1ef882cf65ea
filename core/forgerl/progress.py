"""Following a run from the terminal: a live progress bar over metrics.jsonl, then a summary.

Works for every scheduler whose run directory is visible here (local, and Slurm or
Kubernetes with a shared filesystem): the trainer's rank 0 writes the metrics; this side
only reads them.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

from forgerl import runs
from forgerl.interfaces import Scheduler
from forgerl.types import JobHandle, JobStatus


class MetricsFollower(threading.Thread):
    """Tails metrics.jsonl and updates a tqdm bar until stopped."""

    def __init__(self, path: Path, total: int, enabled: bool = True):
        super().__init__(daemon=True, name="forge-progress")
        self.path = path
        self.total = total
        self.enabled = enabled
        self.stop_event = threading.Event()
        self.last: dict[str, Any] = {}

    def run(self) -> None:
        bar = None
        if self.enabled:
            from tqdm import tqdm

            bar = tqdm(total=self.total, unit="step", file=sys.stderr, dynamic_ncols=True, desc="forge")
        offset = 0
        buf = ""
        while True:
            stopping = self.stop_event.wait(0.5)
            try:
                with open(self.path) as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
            except OSError:
                chunk = ""
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                self.last = row
                if bar is not None:
                    bar.n = min(int(row.get("step", bar.n)), self.total)
                    post = {"reward": f"{row.get('reward/mean', float('nan')):.3f}"}
                    if "eval/accuracy" in row:
                        post["eval_acc"] = f"{row['eval/accuracy']:.3f}"
                    tps = row.get("throughput/gen_tokens_per_s")
                    if tps is not None:
                        post["tok/s"] = f"{tps:.0f}"
                    bar.set_postfix(post, refresh=False)
                    bar.refresh()
            if stopping:
                break
        if bar is not None:
            bar.close()


def follow_run(
    scheduler: Scheduler, handle: JobHandle, run_dir: Path, config: Any, progress: bool = True
) -> JobStatus:
    """Wait for the job with a progress bar; print the run's summary; return its status."""
    total = int(config.loop.steps)
    follower = MetricsFollower(run_dir / runs.METRICS_FILE, total, enabled=progress and sys.stderr.isatty())
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
    if summary:
        before, after = summary.get("eval_accuracy_start"), summary.get("eval_accuracy_end")
        if before is not None or after is not None:
            print(f"  held-out accuracy: {_fmt(before)} -> {_fmt(after)}", file=out)
        if "steps" in summary:
            print(f"  steps: {summary['steps']}   policy version: {summary.get('policy_version')}", file=out)
        phases = summary.get("time", {})
        if phases:
            print("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), file=out)
    print(f"  run directory: {run_dir}", file=out)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
