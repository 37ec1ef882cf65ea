"""The ``code`` reward's formats and options (programs run for real, in the sandbox)."""

from __future__ import annotations

import pytest

from forgerl.plugins import build_registry
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


def test_bwrap_hides_the_hosts_tmp_and_binds_back_what_the_program_needs(tmp_path):
    """The bwrap level's mounts, in bubblewrap's order (later mounts cover earlier ones):
    its programs run only where bwrap is installed (tests/integration/test_code_sandbox.py)."""
    from forgerl_plugins.rewards.sandbox import bwrap_prefix

    box = tmp_path / "box"
    argv = bwrap_prefix(box, "/usr/bin/python3")
    assert argv[-1] == "--" and "--unshare-all" in argv and "--die-with-parent" in argv
    mounts = [tuple(argv[i : i + 3]) for i, a in enumerate(argv) if a in ("--ro-bind", "--bind")]
    assert mounts == [("--ro-bind", "/", "/"), ("--bind", str(box), str(box))]
    assert argv.index("--tmpfs") < argv.index("--bind"), "the box is bound into the fresh /tmp, not hidden by it"
    in_tmp = bwrap_prefix(box, "/tmp/venv-base/bin/python3")
    assert ("--ro-bind", "/tmp/venv-base", "/tmp/venv-base") in zip(in_tmp, in_tmp[1:], in_tmp[2:], strict=False)
