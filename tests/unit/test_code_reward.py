"""The ``code`` reward's formats and options (programs run for real, in the sandbox)."""

from __future__ import annotations

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput
from forgerl_plugins.rewards.code import extract_code

from ..helpers.timing import scaled

ADD = "def add(a, b):\n    return a + b\n"
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"


def reward(**options):
    return build_registry().require("reward", "code").build({"timeout": scaled(5.0), **options})


def scored(r, metadata, completion):
    result = r.score(RewardInput(Problem(id="p", prompt="", metadata=metadata), completion))
    return result.value, dict(result.components)


@pytest.fixture(scope="module")
def code():
    return reward()


@pytest.mark.parametrize(
    ("text", "mode", "program"),
    [
        (f"Sure:\n```python\n{ADD}```\nand usage:\n```python\nprint(add(1, 2))\n```", "fenced", ADD),
        (f"```\n{ADD}```", "fenced", ADD),
        (f"```bash\nls\n```\n```py\n{ADD}```", "fenced", ADD),
        (f"```python\n{ADD}", "fenced", ADD),  # cut off by max_tokens: up to the end
        ("no code here", "fenced", ""),
        ("no code here", "fenced_or_raw", "no code here"),
        (f"```python\n{ADD}```", "raw", f"```python\n{ADD}```"),
    ],
)
def test_the_program_is_taken_from_the_completion(text, mode, program):
    assert extract_code(text, mode) == program


def test_asserts_score_the_share_passed(code):
    tests = [
        "assert add(1, 2) == 3",
        "assert add(2, 2) == 4",
        "assert add('a', 'b') == 'ab'",
        "assert add(0, 0) == 1",
    ]
    value, parts = scored(code, {"tests": tests}, ADD)
    assert value == 0.75
    assert parts == {"pass_rate": 0.75, "all_passed": 0.0, "timeout": 0.0, "error": 0.0}


def test_value_all_passed():
    r = reward(value="all_passed")
    assert scored(r, {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 1"]}, ADD)[0] == 0.0
    assert scored(r, {"tests": ["assert add(1, 2) == 3"]}, ADD)[0] == 1.0


def test_humaneval_check_with_entry_point_and_prefix(code):
    meta = {
        "tests": "def check(candidate):\n    assert candidate(2) == 3\n",
        "entry_point": "inc",
        "prefix": "def inc(x):\n",
    }
    assert scored(code, meta, "    return x + 1\n")[0] == 1.0
    assert scored(code, meta, "    return x\n")[0] == 0.0


def test_setup_code_runs_before_the_tests(code):
    meta = {"tests": ["assert math.floor(half(3)) == 1"], "setup": "import math"}
    assert scored(code, meta, "def half(x):\n    return x / 2\n")[0] == 1.0


def test_stdio_cases_compare_output_up_to_whitespace(code):
    cases = [
        {"input": "1 2\n", "output": "3"},
        {"input": "5 5", "output": "  10\n\n"},
        {"input": "0 0", "output": "1"},
    ]
    value, parts = scored(code, {"stdio": cases}, SUM_STDIN)
    assert value == pytest.approx(2 / 3)
    assert parts["error"] == 0.0 and parts["timeout"] == 0.0


def test_a_crash_and_a_hang_are_components(code):
    assert scored(code, {"tests": ["assert add(1, 2) == 3"]}, "raise SystemExit(3)")[1]["error"] == 1.0
    r = reward(timeout=scaled(1.0))
    assert (
        scored(r, {"stdio": [{"input": "", "output": "1"}]}, "while True:\n    pass\n")[1]["timeout"] == 1.0
    )


def test_a_problem_without_tests_fails_the_sample_saying_so(code):
    with pytest.raises(ValueError, match="no tests"):
        scored(code, {"level": 1}, ADD)


def test_an_unknown_or_unavailable_isolation_is_refused_at_build(monkeypatch):
    from forgerl.errors import ConfigError

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="isolation 'bwrap' is not available"):
        reward(isolation="bwrap")


def test_bwrap_builds_the_root_of_the_view_and_binds_back_what_the_program_needs(tmp_path):
    """The bwrap level's mounts, in bubblewrap's order (later mounts cover earlier ones):
    its programs run only where bwrap is installed (tests/integration/test_code_sandbox.py)."""
    from forgerl_plugins.rewards.sandbox import bwrap_prefix
    from forgerl_plugins.rewards.sandbox_root import RootView

    box = tmp_path / "box"
    view = RootView(
        binds=("/usr/lib", "/usr/bin", "/tmp/venv-base/lib/python3.11", "/tmp/venv-base/bin/python3.11"),
        links=(("/lib", "usr/lib"),), hidden=("/usr/lib/python3/dist-packages",), devices=("/dev/null",),
    )  # fmt: skip
    argv = bwrap_prefix(box, view)
    assert argv[-1] == "--" and "--unshare-all" in argv and "--die-with-parent" in argv
    ops, i = [], 0
    while i < len(argv):  # the mount operations with their arguments, in order
        width = {"--ro-bind": 3, "--bind": 3, "--symlink": 3, "--tmpfs": 2, "--remount-ro": 2}.get(argv[i], 1)
        if width > 1:
            ops.append(tuple(argv[i : i + width]))
        i += width
    assert ("--ro-bind", "/", "/") not in ops, "the host's root is not the program's"
    assert ops == [
        ("--ro-bind", "/usr/lib", "/usr/lib"), ("--ro-bind", "/usr/bin", "/usr/bin"),
        ("--tmpfs", "/tmp"),  # the host's hidden; what the program needs of it bound back
        ("--ro-bind", "/tmp/venv-base/lib/python3.11", "/tmp/venv-base/lib/python3.11"),
        ("--ro-bind", "/tmp/venv-base/bin/python3.11", "/tmp/venv-base/bin/python3.11"),
        ("--tmpfs", "/usr/lib/python3/dist-packages"), ("--remount-ro", "/usr/lib/python3/dist-packages"),
        ("--symlink", "usr/lib", "/lib"),
        ("--bind", str(box), str(box)), ("--remount-ro", "/tmp"),  # its directory the one writable place
        ("--remount-ro", "/"),
    ]  # fmt: skip


# ------------------------------------------------ tests here, the program in its sandbox


@pytest.mark.parametrize(
    ("program", "tests"),
    [
        # A class: the instance stays in the program, its methods and attributes answer.
        (
            "class Stack:\n    def __init__(self):\n        self.items = []\n"
            "    def push(self, x):\n        self.items.append(x)\n        return self\n",
            ["s = Stack()\ns.push(1).push(2)\nassert s.items == [1, 2] and len(s.items) == 2"],
        ),
        # A generator, iterated by the test; a dict subclass compared as a dict.
        (
            "import collections\ndef evens(n):\n    yield from range(0, n, 2)\n"
            "def count(xs):\n    return collections.Counter(xs)\n",
            ["assert list(evens(7)) == [0, 2, 4, 6]", "assert count('aab') == {'a': 2, 'b': 1}"],
        ),
        # A function that changes its argument in place, and one that raises what the test expects.
        (
            "def sort_in_place(xs):\n    xs.sort()\ndef parse(s):\n    return int(s)\n",
            [
                "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
                "try:\n    parse('x')\n    raise AssertionError('no error')\nexcept ValueError:\n    pass",
            ],
        ),
        # The program's module import and plain globals reach the tests; tuples stay tuples.
        (
            "import math\nLIMIT = 10\ndef pair(x):\n    return (x, math.sqrt(x))\n",
            ["assert LIMIT == 10 and pair(4) == (4, 2.0) and math.floor(2.5) == 2"],
        ),
    ],
    ids=["class", "generator-and-counter", "in-place-and-raises", "globals-and-modules"],
)
def test_what_tests_do_with_a_program_works_across_the_sandbox(code, program, tests):
    value, parts = scored(code, {"tests": tests}, program)
    assert (value, parts["error"]) == (1.0, 0.0), parts


def test_a_wrong_answer_of_each_kind_fails(code):
    program = "def f(x):\n    return [x]\ndef g(x):\n    raise KeyError(x)\n"
    tests = ["assert f(1) == (1,)", "assert f(1) == [2]", "assert g(1) == 1", "assert f(1) is not None"]
    value, parts = scored(code, {"tests": tests}, program)
    assert value == 0.25 and parts["error"] == 0.0, parts


def test_the_program_never_sees_the_tests(code):
    """The tests and their expected values stay in the reward's process: the program's
    directory holds only itself, and a program looking for them finds nothing."""
    program = (
        "import os\nFOUND = sorted(os.listdir('.'))\n"
        "def seen():\n    return [n for n in FOUND if n not in ('main.py', 'solution.py')]\n"
    )
    assert scored(code, {"tests": ["assert seen() == []"]}, program)[0] == 1.0


def test_decoding_builds_only_builtin_values():
    from forgerl_plugins.rewards.code_wire import from_wire, to_wire

    value = {"a": (1, 2.5, None), 3: [b"\x00", {1, 2}, frozenset({"x"}), 1 + 2j], "t": True}
    assert from_wire(to_wire(value, make_ref=id), lambda n, t: (n, t)) == value
    for bad in ({"list": []}, {"dict": [[1]]}, {"tuple": 1}, {"ref": "1", "type": "x"}, {"complex": ["1", 2]}):
        with pytest.raises((ValueError, TypeError)):
            from_wire(bad, lambda n, t: None)
    deep: list = []
    for _ in range(500):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deeply"):
        from_wire(deep, lambda n, t: None)
