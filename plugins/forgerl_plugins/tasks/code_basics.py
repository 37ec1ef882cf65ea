"""The ``code_basics`` task: a handful of very easy Python functions with assert tests.

Small enough to ship in the package and to check a run with the ``code`` reward end to
end (``forge run --task code_basics --reward code``); a small instruction model solves
some of them, so a run has reward variance to learn from. Rows use the ``file`` task's
``code`` format, and the task is that task over these rows.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from forgerl.options import OptionsModel
from forgerl_plugins.tasks.file import FileTask


def _row(name: str, ask: str, tests: list[str], solution: str) -> dict[str, Any]:
    return {
        "id": f"code_basics/{name}",
        "prompt": f"Write a Python function `{name}` that {ask}.",
        "tests": tests,
        "entry_point": name,
        "solution": solution,
    }


PROBLEMS = [
    _row("add", "returns the sum of a and b", ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"],
         "def add(a, b):\n    return a + b\n"),
    _row("subtract", "returns a minus b", ["assert subtract(5, 3) == 2", "assert subtract(0, 7) == -7"],
         "def subtract(a, b):\n    return a - b\n"),
    _row("double", "returns twice its argument x", ["assert double(4) == 8", "assert double(-1) == -2"],
         "def double(x):\n    return 2 * x\n"),
    _row("square", "returns x squared", ["assert square(3) == 9", "assert square(-5) == 25"],
         "def square(x):\n    return x * x\n"),
    _row("is_even", "returns True when the integer n is even", ["assert is_even(4)", "assert not is_even(7)"],
         "def is_even(n):\n    return n % 2 == 0\n"),
    _row("larger", "returns the larger of a and b", ["assert larger(2, 9) == 9", "assert larger(5, 1) == 5"],
         "def larger(a, b):\n    return max(a, b)\n"),
    _row("first", "returns the first item of a list", ["assert first([7, 8]) == 7", "assert first('ab') == 'a'"],
         "def first(items):\n    return items[0]\n"),
    _row("length", "returns the length of a string s", ["assert length('abc') == 3", "assert length('') == 0"],
         "def length(s):\n    return len(s)\n"),
    _row("reverse", "returns the string s reversed", ["assert reverse('abc') == 'cba'", "assert reverse('') == ''"],
         "def reverse(s):\n    return s[::-1]\n"),
    _row("total", "returns the sum of a list of numbers", ["assert total([1, 2, 3]) == 6", "assert total([]) == 0"],
         "def total(numbers):\n    return sum(numbers)\n"),
    _row("greet", "returns 'Hello, ' followed by the name", ["assert greet('Ann') == 'Hello, Ann'"],
         "def greet(name):\n    return 'Hello, ' + name\n"),
    _row("negate", "returns -x", ["assert negate(3) == -3", "assert negate(-2) == 2"],
         "def negate(x):\n    return -x\n"),
]  # fmt: skip


class CodeBasicsTask(FileTask):
    name = "code_basics"
    description = "very easy Python functions with assert tests (for the code reward)"

    class Options(OptionsModel):
        eval_fraction: float = Field(0.25, ge=0, lt=1, description="Share of the problems held out for eval.")
        system_prompt: str | None = Field(
            "Write the Python function asked for. Answer with the code in one ```python block.",
            description="System message put before every prompt.",
        )

    @staticmethod
    def preflight(options: CodeBasicsTask.Options) -> None:  # type: ignore[override]
        """Nothing to check: the rows ship with the package (the file task checks a path)."""

    def __init__(self, options: Options, *, seed: int = 0):
        file_options = FileTask.Options(
            path="<code_basics>",
            eval_fraction=options.eval_fraction,
            system_prompt=options.system_prompt,
            format="code",
        )
        super().__init__(file_options, seed=seed)

    def _rows(self, options: FileTask.Options) -> list[dict[str, Any]]:
        return [dict(row) for row in PROBLEMS]
