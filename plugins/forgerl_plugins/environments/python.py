"""The ``python`` environment: arithmetic problems (from the run's task) with a
``run_python(code)`` tool that runs the model's program in the ``code`` reward's sandbox
(:mod:`forgerl_plugins.rewards.sandbox`) and answers with its exit status, stdout and
stderr, cut to ``max_output_chars`` each.

The program is hostile input. It runs as the ``code`` reward's programs do: a fresh
directory, resource limits (wall clock, CPU, address space, processes, file size, open
files), and at the ``namespace`` level no network, a PID namespace of its own and nothing
writable outside its directory (docs/rewards.md, "Isolation"). A program that loops,
forks, eats memory or floods its output is stopped and its end is the tool's answer: the
model reads it and the trajectory goes on. Every program of one assistant turn, waiting
for a free sandbox slot included, ends within ``turn_seconds`` (keep it under
``environment.turn_timeout``), so a step returns in time however many programs the turn
asks for. A sandbox that cannot run a program at all (not the program's failure) fails
the trajectory, as it fails the ``code`` reward's sample.

Reward as ``calculator``: 1 for the right number inside ``<answer></answer>``.
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from typing import Any

from pydantic import Field

from forgerl.environment import Environment, Message, Step, tool
from forgerl.options import OptionsModel
from forgerl.types import Problem

SYSTEM = (
    "You solve arithmetic problems. You can run Python 3 programs with the run_python tool: "
    "print what you want to see. Then give the final answer inside <{tag}></{tag}>."
)


class PythonEnvironment(Environment):
    """arithmetic with a run_python(code) tool, sandboxed; reward 1 for the right answer"""

    name = "python"
    scores = True

    class Options(OptionsModel):
        tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]*$", description="The answer goes inside <tag></tag>.")
        timeout: float = Field(3.0, gt=0, le=600, description="Wall-clock seconds per program.")
        turn_seconds: float = Field(
            8.0, gt=0, le=3600,
            description="Seconds the programs of one assistant turn may take together, waiting for a sandbox "
            "slot included; keep it under environment.turn_timeout.",
        )  # fmt: skip
        memory_mb: int = Field(256, ge=64, le=1 << 20, description="Address space per program, MiB.")
        processes: int = Field(16, ge=1, le=4096, description="Processes a program may have (RLIMIT_NPROC).")
        file_size_mb: int = Field(1, ge=1, le=1 << 20, description="Largest file (and output) a program may write, MiB.")
        open_files: int = Field(64, ge=16, le=65536, description="Open file descriptors per program.")
        max_output_chars: int = Field(
            1500, ge=100, le=1900, description="Characters of stdout, and of stderr, the model reads back."
        )
        isolation: str = Field(
            "auto", pattern="^(auto|namespace|bwrap|process)$",
            description="Sandbox level, as the code reward's; an explicit level this machine lacks stops the run at start.",
        )  # fmt: skip
        concurrency: int | None = Field(
            None, ge=1, le=1024, description="Programs at once on this machine (default: the usable cores)."
        )
        python: str | None = Field(None, description="Interpreter for the programs (default: this one).")
        workdir: str | None = Field(None, description="Where the per-program directories go (default: the temp dir).")

    @staticmethod
    def preflight(options: PythonEnvironment.Options) -> None:
        """Before ``forge run`` creates the run directory: the isolation asked for exists here."""
        sandbox_for(options)

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()
        self.sandbox = sandbox_for(self.options)
        self.problem: Problem | None = None
        self.runs = 0
        #: When the programs of the turn being answered must have ended (time.monotonic()).
        self.turn_ends: float | None = None
        #: Why the sandbox could not run a program: the trajectory fails at the end of the turn.
        self.broken: str | None = None

    def reset(self, problem: Problem) -> list[Message]:
        from forgerl_plugins.environments.calculator import question_of

        self.problem = problem
        return [
            {"role": "system", "content": SYSTEM.format(tag=self.options.tag)},
            {"role": "user", "content": question_of(problem)},
        ]

    def step(self, assistant_text: str) -> Step:
        self.turn_ends = time.monotonic() + self.options.turn_seconds
        step = super().step(assistant_text)
        if self.broken is not None:
            raise RuntimeError(f"the sandbox could not run a program: {self.broken}")
        return step

    @tool
    def run_python(self, code: str) -> str:
        """Run a Python 3 program (standard library only) and return its exit status and output.

        Args:
            code: the whole program; print the values you need
        """
        from forgerl_plugins.rewards.sandbox import SandboxBusy

        ends = self.turn_ends if self.turn_ends is not None else time.monotonic() + self.options.timeout
        try:
            outcome = self.sandbox.run({"main.py": code}, deadline=ends)
        except SandboxBusy:
            return "error: no time left in this turn to run the program (it did not run)"
        if outcome.setup_error is not None:
            self.broken = outcome.setup_error
            raise RuntimeError("the sandbox failed; the program did not run")
        self.runs += 1
        return describe(outcome, self.options.max_output_chars)

    def answer(self, assistant_text: str) -> Step:
        from forgerl_plugins.environments.calculator import arithmetic_verdict

        assert self.problem is not None, "answer before reset"
        correct, tagged = arithmetic_verdict(assistant_text, self.problem, self.options.tag)
        return Step.finish(
            float(correct), correct=float(correct), used_tool=float(self.runs > 0), tagged=float(tagged),
            programs=float(self.runs),
        )  # fmt: skip


_SANDBOX_LOCK = threading.Lock()


@functools.cache
def _sandbox(options_json: str) -> Any:
    from forgerl_plugins.rewards.sandbox import Limits, Sandbox

    o = PythonEnvironment.Options.model_validate_json(options_json)
    return Sandbox(
        isolation=o.isolation,
        limits=Limits(
            wall_seconds=o.timeout,
            cpu_seconds=max(1, math.ceil(o.timeout)),
            memory_mb=o.memory_mb,
            processes=o.processes,
            file_size_mb=o.file_size_mb,
            open_files=o.open_files,
            max_output_bytes=4 * o.max_output_chars + 4,  # enough bytes for the characters kept
        ),
        concurrency=o.concurrency,
        python=o.python,
        workdir=o.workdir,
    )


def sandbox_for(options: PythonEnvironment.Options) -> Any:
    """The sandbox for ``options``: one per process and options (its level is probed
    once, by running a program), shared by the instances, one per trajectory."""
    # The run builds its first `environment.concurrency` instances on as many threads at
    # once: unlocked, each would miss the cache and build a sandbox of its own (each with its
    # own slots, so more programs than `concurrency` would run at once).
    with _SANDBOX_LOCK:
        return _sandbox(options.model_dump_json())


def describe(outcome: Any, max_chars: int) -> str:
    """What the model reads of a finished program: how it ended, the head of its stdout,
    the tail of its stderr (a traceback's last lines say what went wrong)."""
    if outcome.timed_out:
        parts = ["the program was stopped: it ran out of time"]
    elif outcome.signal is not None:
        parts = [f"the program was killed by signal {_signal_name(outcome.signal)}"]
    else:
        parts = [f"exit code {outcome.exit_code}"]
    if outcome.stdout:
        out = outcome.stdout
        parts.append("stdout:\n" + (out if len(out) <= max_chars else out[:max_chars] + "\n...(cut)"))
    if outcome.stderr:
        err = outcome.stderr
        parts.append("stderr:\n" + (err if len(err) <= max_chars else "(cut)...\n" + err[-max_chars:]))
    if not outcome.stdout and not outcome.stderr:
        parts.append("(no output)")
    return "\n".join(parts)


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)
