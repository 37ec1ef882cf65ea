"""``Sandbox.run(..., deadline=)``: the python environment's bound on a turn. The program
is stopped by the deadline whatever its own wall clock, and a caller that finds no free
slot in time is told so (SandboxBusy) instead of waiting on (programs run for real)."""

from __future__ import annotations

import time

import pytest

from forgerl_plugins.rewards.sandbox import Limits, Sandbox, SandboxBusy

from ..helpers.timing import scaled


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(limits=Limits(wall_seconds=scaled(60.0), cpu_seconds=120), concurrency=1)


def test_the_deadline_cuts_the_programs_wall_clock(sandbox):
    start = time.monotonic()
    outcome = sandbox.run({"main.py": "while True:\n    pass\n"}, deadline=start + 1.0)
    took = time.monotonic() - start
    assert outcome.timed_out, outcome
    assert took < scaled(10.0), f"a 1 s deadline let a program with a 60 s wall clock run {took:.1f} s"


def test_no_free_slot_before_the_deadline_is_sandbox_busy(sandbox):
    with sandbox._slots.take():  # the only slot, held as another program would hold it
        start = time.monotonic()
        with pytest.raises(SandboxBusy, match="busy until the deadline"):
            sandbox.run({"main.py": "print(1)\n"}, deadline=start + 0.5)
        assert time.monotonic() - start < scaled(5.0)
    assert sandbox.run({"main.py": "print(1)\n"}, deadline=time.monotonic() + scaled(10.0)).stdout == "1\n"


def test_without_a_deadline_the_programs_own_limits_hold(sandbox):
    outcome = sandbox.run({"main.py": "print(6 * 7)\n"})
    assert (outcome.exit_code, outcome.stdout) == (0, "42\n")
