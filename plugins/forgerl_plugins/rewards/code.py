"""The ``code`` reward: run the completion's program against the problem's tests, sandboxed.

The tests come from the problem's metadata (the ``file`` task passes a row's extra fields
through; docs/rewards.md has the format):

- ``stdio``: a list of ``{"input", "output"}`` cases; the program reads stdin, and its
  output must equal the expected one up to whitespace (compared token by token). Each case
  is a separate run.
- ``tests`` as a list of statements (MBPP: ``assert f(1) == 2``): each must run without
  raising after the program has been executed; one run reports each test.
- ``tests`` as text defining ``check(candidate)`` with ``entry_point`` (HumanEval): one
  test, ``check(<entry_point>)``.

``setup`` (optional) is code run before the program and the tests; ``prefix`` (optional,
HumanEval's prompt) is put before the completion's code. The tests run in this process,
the program in the sandbox, and only plain values cross between them
(:mod:`.code_tests`): nothing the program does decides a test's verdict but the values it
returns.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput, RewardResult
from forgerl_plugins.rewards.code_tests import run_tests
from forgerl_plugins.rewards.sandbox import Job, Limits, Sandbox, run_all
from forgerl_plugins.rewards.sandbox_outcome import RunOutcome

log = logging.getLogger("forgerl.rewards")

_FENCE = re.compile(r"```[ \t]*([\w+#-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3", "")


def extract_code(text: str, mode: str) -> str:
    """The program in a completion: the first fenced block tagged python (or untagged),
    else (``fenced_or_raw``, ``raw``) the whole text."""
    if mode != "raw":
        blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(text)]
        for tag, body in blocks:
            if tag in _PYTHON_TAGS:
                return body
        if mode == "fenced":
            return ""
    return text


def sandbox_for(options: CodeReward.Options) -> Sandbox:
    return Sandbox(
        isolation=options.isolation,
        limits=Limits(
            wall_seconds=options.timeout,
            cpu_seconds=options.cpu_seconds or max(1, int(options.timeout + 0.999)),
            memory_mb=options.memory_mb,
            processes=options.processes,
            file_size_mb=options.file_size_mb,
            open_files=options.open_files,
            max_output_bytes=options.max_output_kb * 1024,
        ),
        concurrency=options.concurrency,
        python=options.python,
        workdir=options.workdir,
    )


class CodeReward(Reward):
    name = "code"
    description = "the completion's program passes the problem's tests (sandboxed)"

    class Options(OptionsModel):
        value: str = Field(
            "pass_rate",
            pattern="^(pass_rate|all_passed)$",
            description="The reward: share of tests passed, or 1 if all.",
        )
        code_from: str = Field(
            "fenced_or_raw",
            pattern="^(fenced|raw|fenced_or_raw)$",
            description="The program: the first python code block, the whole text, or the block else the text.",
        )
        isolation: str = Field(
            "auto",
            pattern="^(auto|namespace|bwrap|process)$",
            description="Sandbox level; an explicit level that this machine lacks stops the run at start.",
        )
        timeout: float = Field(5.0, gt=0, le=600, description="Wall-clock seconds per program run.")
        cpu_seconds: int | None = Field(
            None, ge=1, le=600, description="CPU seconds per run (default: timeout)."
        )
        memory_mb: int = Field(1024, ge=64, le=1 << 20, description="Address space per run, MiB.")
        processes: int = Field(
            32, ge=1, le=4096, description="Processes the program may have (RLIMIT_NPROC)."
        )
        file_size_mb: int = Field(
            16, ge=1, le=1 << 20, description="Largest file the program may write, MiB."
        )
        open_files: int = Field(64, ge=16, le=65536, description="Open file descriptors per run.")
        max_output_kb: int = Field(64, ge=1, le=1 << 20, description="Stdout/stderr read back per run, KiB.")
        concurrency: int | None = Field(
            None, ge=1, le=1024, description="Programs at once on this machine (default: the usable cores)."
        )
        python: str | None = Field(None, description="Interpreter for the programs (default: this one).")
        workdir: str | None = Field(
            None, description="Where the per-run directories go (default: the temp dir)."
        )

    @staticmethod
    def preflight(options: CodeReward.Options) -> None:
        """Before ``forge run`` creates the run directory: the isolation asked for exists here."""
        sandbox_for(options)

    def __init__(self, options: Options):
        self.options = options
        self.sandbox = sandbox_for(options)
        log.info("code reward: %s", self.sandbox.describe())

    def score(self, sample: RewardInput) -> RewardResult:
        meta = sample.problem.metadata
        code = str(meta.get("prefix") or "") + extract_code(sample.completion_text, self.options.code_from)
        if meta.get("stdio") is not None:
            results = self._stdio(code, meta["stdio"])
        else:
            results = self._tests(code, meta, sample.problem.id)
        passed, timed_out, errored = results
        total = len(passed)
        pass_rate = sum(passed) / total if total else 0.0
        all_passed = float(total > 0 and all(passed))
        components = {
            "pass_rate": pass_rate,
            "all_passed": all_passed,
            "timeout": float(timed_out),
            "error": float(errored),
        }
        value = pass_rate if self.options.value == "pass_rate" else all_passed
        return RewardResult(value=value, components=components)

    # --------------------------------------------------------------- formats

    def _stdio(self, code: str, cases: Any) -> tuple[list[bool], bool, bool]:
        if not isinstance(cases, list) or not cases:
            raise ValueError("metadata 'stdio' must be a non-empty list of {'input', 'output'} cases")
        jobs: list[Job] = [
            {"files": {"main.py": code}, "stdin": str(case.get("input", ""))} for case in cases
        ]
        outcomes = run_all(self.sandbox, jobs)
        _raise_on_setup_error(outcomes)
        passed = [
            o.ok and o.stdout.split() == str(case.get("output", "")).split()
            for o, case in zip(outcomes, cases, strict=True)
        ]
        timed_out = any(o.timed_out for o in outcomes)
        errored = any(not o.timed_out and o.exit_code != 0 for o in outcomes)
        return passed, timed_out, errored

    def _tests(self, code: str, meta: Mapping[str, Any], problem_id: str) -> tuple[list[bool], bool, bool]:
        tests = meta.get("tests")
        if isinstance(tests, str):
            entry_point = meta.get("entry_point")
            if not entry_point:
                raise ValueError(f"problem {problem_id}: 'tests' as text (HumanEval) needs an 'entry_point'")
            tests = [f"{tests}\ncheck({entry_point})"]
        elif not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            raise ValueError(
                f"problem {problem_id} has no tests for the code reward: metadata needs 'tests' "
                "(a list of assert statements, or check(candidate) text with 'entry_point') or 'stdio' cases"
            )
        run = run_tests(self.sandbox, program=code, setup=str(meta.get("setup") or ""), tests=tests)
        if run.reason:
            log.debug("code reward, problem %s: %s", problem_id, run.reason)
        return run.passed, run.timed_out, run.errored


def _raise_on_setup_error(outcomes: list[RunOutcome]) -> None:
    for o in outcomes:
        if o.setup_error:
            # The sandbox failed, not the program: the sample is scored failed, with why.
            raise RuntimeError(f"the sandbox could not run the program: {o.setup_error}")
