"""The ``file`` task's ``code`` format and the built-in ``code_basics`` task."""

from __future__ import annotations

import json

import pytest

from forgerl.errors import ConfigError
from forgerl.registry.plugins import build_registry
from forgerl.types import RewardInput
from forgerl_plugins.tasks.code_basics import PROBLEMS


def file_task(tmp_path, rows, **options):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (
        build_registry()
        .require("task", "file")
        .build({"path": str(path), "format": "code", "eval_fraction": 0, **options}, seed=0)
    )


def test_a_code_row_carries_its_tests_and_its_reference_solution(tmp_path):
    row = {
        "id": "p1",
        "prompt": "Write f.",
        "tests": ["assert f() == 1"],
        "entry_point": "f",
        "solution": "def f(): return 1",
    }
    (problem,) = file_task(tmp_path, [row]).next_problems(1)
    assert problem.id == "p1"
    assert problem.answer == "def f(): return 1"
    assert problem.metadata == {"tests": ["assert f() == 1"], "entry_point": "f"}
    assert problem.prompt == [{"role": "user", "content": "Write f."}]


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "Write f."}, 'needs "tests"'),
        ({"prompt": "Write f.", "tests": "def check(c): pass"}, '"entry_point"'),
        ({"prompt": "Echo.", "stdio": [{"input": "x"}]}, '"stdio" must be'),
        ({"prompt": "Write f.", "tests": []}, 'needs "tests"'),
    ],
)
def test_a_code_row_without_usable_tests_is_refused_with_its_row(tmp_path, row, says):
    with pytest.raises(ConfigError, match=says) as err:
        file_task(tmp_path, [row])
    assert "row 1" in str(err.value)


def test_every_built_in_code_problem_is_solved_by_its_reference_solution():
    """The shipped problems are right: each reference solution passes its tests in the sandbox."""
    reward = build_registry().require("reward", "code").build({"timeout": 20})
    task = build_registry().require("task", "code_basics").build({"eval_fraction": 0}, seed=0)
    problems = task.next_problems(len(PROBLEMS))
    assert {p.id for p in problems} == {row["id"] for row in PROBLEMS}
    for problem in problems:
        result = reward.score(RewardInput(problem, f"```python\n{problem.answer}```"))
        assert result.value == 1.0, (problem.id, result)
        assert reward.score(RewardInput(problem, "def nothing():\n    pass\n")).value == 0.0, problem.id
