"""Running ``forge`` from a benchmark script.

A benchmark is a chain of runs that takes tens of minutes; a run directory that holds a
``summary.json`` was finished by an earlier invocation and is reused, so a chain broken at
its third run resumes there. A failing command ends the benchmark with what failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORGE = [sys.executable, "-m", "forgerl.cli"]


@dataclass
class FinishedRun:
    dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]  # metrics.jsonl
    wall_s: float | None  # None when an earlier invocation made the run
    load: list[float]  # 1-, 5- and 15-minute load averages before, then after (empty when reused)


def forge(run_dir: Path, args: list[str]) -> FinishedRun:
    """``forge ARGS --output RUN_DIR`` (ARGS starts with the command: run, sft, ...)."""
    wall, load = None, []
    if not (run_dir / "summary.json").is_file():
        before = os.getloadavg()
        start = time.perf_counter()
        check([*FORGE, *args, "--output", str(run_dir), "--set", "logging.progress=false"], f"forge {args[0]} {run_dir}")
        wall = round(time.perf_counter() - start, 1)
        load = [round(x, 1) for x in (*before, *os.getloadavg())]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return FinishedRun(run_dir, summary, rows, wall, load)


def check(command: list[str], what: str) -> None:
    """Run COMMAND; its failure ends the benchmark with WHAT in the message."""
    done = subprocess.run(command)
    if done.returncode != 0:
        sys.exit(f"{what} failed with exit status {done.returncode}")
