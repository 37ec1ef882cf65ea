"""A plugin that holds a run at one step, so a test can kill it there.

Tests that kill a run "after its second checkpoint" must not race the run: on a fast
machine the tiny model finishes all its steps between two polls. Loaded through
``FORGE_PLUGINS=tests.helpers.hold_at_step`` with ``FORGE_TEST_HOLD_AT_STEP=N``, the
``forge_step_end`` hook of step N (called once step N's row is written and, when due,
its checkpoint saved) writes ``held-at-step-N`` in the run directory (:func:`marker`) and
then blocks on rank 0, which drives the loop, until the test kills the run or writes
``release-step-N`` (:func:`release`). :func:`hold_env` builds that environment; it holds
at several steps in turn when given several (``FORGE_TEST_HOLD_AT_STEP=1,2``).

It also holds a run's *rollouts*: with ``--task held_arithmetic`` (the ``arithmetic`` task)
and ``FORGE_TEST_HOLD_PROBLEMS=FILE``, every request for training problems after the first
batch's waits while FILE exists, after touching ``FILE.waiting`` (:func:`problems_waiting`):
so the next batch's generation starts when the test says, not while it holds a step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from forgerl.hookspecs import hookimpl
from forgerl.types import Problem
from forgerl_plugins.tasks.arithmetic import ArithmeticTask

from .timing import scaled, wait_until


def hold_env(*steps: int) -> dict[str, str]:
    """The environment of a `forge run` that holds at each of ``steps`` (the repo on its path)."""
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    held = ",".join(str(s) for s in steps)
    return {**os.environ, "PYTHONPATH": path, "FORGE_PLUGINS": __name__, "FORGE_TEST_HOLD_AT_STEP": held}


def marker(run_dir: Path, step: int) -> Path:
    return run_dir / f"held-at-step-{step}"


def release(run_dir: Path, step: int) -> None:
    (run_dir / f"release-step-{step}").write_text("")


def kill_run_held_at(
    command: Sequence[str], run_dir: Path, step: int, *, before_kill: Callable[[], None] | None = None
) -> subprocess.Popen[str]:
    """Start ``command`` (a `forge run` or `forge sft` writing ``run_dir``), hold it at
    ``step`` (after that step's row and checkpoint), call ``before_kill``, then SIGKILL
    every process of its job, as a crash would; the ended front process is returned."""
    front = subprocess.Popen([*command], env=hold_env(step), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        wait_until(lambda: marker(run_dir, step).exists(), 240, f"the run to reach its checkpoint {step}",
                   interval=0.2)  # fmt: skip
        if before_kill is not None:
            before_kill()
        for process in json.loads((run_dir / "job.json").read_text())["processes"]:
            os.kill(process["pid"], signal.SIGKILL)
        front.wait(timeout=scaled(60))
    finally:
        if front.poll() is None:
            front.kill()
    return front


@hookimpl
def forge_step_end(step: int, metrics: Mapping[str, Any], run_dir: Path) -> None:
    raw = os.environ.get("FORGE_TEST_HOLD_AT_STEP")
    if raw is None or step not in {int(s) for s in raw.split(",")}:
        return
    run_dir = Path(run_dir)
    marker(run_dir, step).write_text(str(os.getpid()))
    released = run_dir / f"release-step-{step}"
    while not released.exists():  # or the test's SIGKILL
        time.sleep(0.05)


def problems_waiting(gate: Path) -> Path:
    """Touched when a request for problems waits for ``gate`` to go."""
    return gate.with_name(gate.name + ".waiting")


class HeldArithmetic(ArithmeticTask):
    name = "held_arithmetic"
    description = "test-only: the arithmetic task, whose problems after the first batch wait for a file to go"

    def next_problems(self, n: int) -> list[Problem]:
        raw = os.environ.get("FORGE_TEST_HOLD_PROBLEMS")
        if raw and self.position > 0:
            gate = Path(raw)
            if gate.exists():
                problems_waiting(gate).touch()
            while gate.exists():  # or the test's SIGKILL
                time.sleep(0.05)
        return super().next_problems(n)


@hookimpl
def forge_tasks() -> list[type]:
    return [HeldArithmetic]
