"""forgerl's own rewards and tasks pass the conformance kits of forgerl.testing, run the way
a third-party plugin runs them: by naming the backend and its options."""

from __future__ import annotations

import json

import pytest

from forgerl.testing import RewardContract, TaskContract
from forgerl.types import Problem, RewardInput

QUESTION = Problem(id="q", prompt="What is 17 + 25?", answer="42", metadata={"answer_type": "integer"})


class TestMathAnswerReward(RewardContract):
    backend = "math_answer"
    completions = ("17 + 25 = 42, so <answer>42</answer>", "It is 42.", "<answer>\\frac{1}{2}</answer>")
    known_scores = (
        (RewardInput(QUESTION, "so <answer>42</answer>"), 1.0),
        (RewardInput(QUESTION, "it is 42"), 0.5),  # fallback_credit: right, but not in the tag
        (RewardInput(QUESTION, "<answer>17 + 25</answer>"), 0.0),  # restates the question
    )


class TestMathAnswerRewardWithoutTag(RewardContract):
    backend = "math_answer"
    options = {"tag": None}


class TestFormatReward(RewardContract):
    backend = "format"
    known_scores = (
        (RewardInput(QUESTION, "<answer>42</answer>"), 1.0),
        (RewardInput(QUESTION, "<answer></answer>"), 0.0),
    )


class TestFormatRewardFullmatch(RewardContract):
    backend = "format"
    options = {"pattern": r"\s*<answer>.*</answer>\s*", "mode": "fullmatch"}


class TestArithmeticTask(TaskContract):
    backend = "arithmetic"
    options = {"operations": ["+", "-", "*"], "eval_size": 16}


class TestArithmeticTaskSmallSpace(TaskContract):
    """A space of 36 problems, 8 held out: the stream repeats problems, never eval ones."""

    backend = "arithmetic"
    options = {"min_value": 1, "max_value": 6, "eval_size": 8}


class TestFileTask(TaskContract):
    """A file of 13 rows, smaller than what the kit asks for at once: it cycles through epochs."""

    backend = "file"

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        path = tmp_path / "problems.jsonl"
        rows = [
            {"id": f"r{i}", "prompt": f"What is {i} * 3?", "answer": str(3 * i), "level": i % 3}
            for i in range(10)
        ] + [
            {"prompt": [{"role": "user", "content": f"Say {w}."}], "answer": w}
            for w in ("yes", "no", "maybe")
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.options = {"path": str(path), "eval_fraction": 0.2, "system_prompt": "Be brief."}


def _dataset_rows(tmp_path, name="problems.jsonl", n=12):
    path = tmp_path / name
    rows = [
        {"uid": f"r{i}", "question": f"What is {i} * 3?", "solution": 3 * i, "level": i % 3} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class TestDatasetTask(TaskContract):
    """Mapped columns, a template, a held-out fraction."""

    backend = "dataset"

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        self.options = {
            "path": _dataset_rows(tmp_path),
            "columns": {"prompt": "question", "answer": "solution", "id": "uid"},
            "prompt_template": "{prompt} (level {level})",
            "eval_fraction": 0.25,
        }


class TestDatasetTaskStreaming(TaskContract):
    """Streamed through a shuffle buffer, with a held-out file."""

    backend = "dataset"

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        self.options = {
            "path": _dataset_rows(tmp_path),
            "eval_path": _dataset_rows(tmp_path, "held.jsonl", 3),
            "columns": {"prompt": "question", "answer": "solution", "id": "uid"},
            "streaming": True,
            "shuffle_buffer": 5,
        }


class TestMixtureTask(TaskContract):
    backend = "mixture"

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        columns = {"prompt": "question", "answer": "solution", "id": "uid"}
        self.options = {
            "sources": [
                {"name": "a", "weight": 2, "dataset": {"path": _dataset_rows(tmp_path), "columns": columns,
                                                        "eval_fraction": 0.25}},
                {"name": "b", "dataset": {"path": _dataset_rows(tmp_path, "b.jsonl", 5), "columns": columns,
                                          "streaming": True}},
            ]
        }  # fmt: skip


ADD = Problem(
    id="kit/add",
    prompt="Write a Python function add(a, b) that returns their sum.",
    metadata={"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
)


class TestCodeReward(RewardContract):
    """Every text of the kit's battery runs as a program in the sandbox."""

    backend = "code"
    options = {"timeout": 10}
    completions = ("```python\ndef add(a, b):\n    return a + b\n```", "def add(a, b): return a - b")
    known_scores = (
        (RewardInput(ADD, "Here:\n```python\ndef add(a, b):\n    return a + b\n```"), 1.0),
        (RewardInput(ADD, "def add(a, b):\n    return 3"), 0.5),
        (RewardInput(ADD, "import sys\nsys.exit(0)"), 0.0),
    )

    def problems(self) -> list[Problem]:
        return [ADD]


class TestCodeBasicsTask(TaskContract):
    backend = "code_basics"


class TestFileTaskCodeFormat(TaskContract):
    """Code problems from a file: the tests reach the rewards as metadata."""

    backend = "file"

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        path = tmp_path / "code.jsonl"
        rows = [
            {"prompt": f"Write f(x) returning x + {i}.", "tests": [f"assert f(1) == {1 + i}"], "solution": "..."}
            for i in range(6)
        ] + [
            {"prompt": "Echo a line.", "stdio": [{"input": "hi\n", "output": "hi"}]},
            {"prompt": "Write g.", "tests": "def check(c):\n    assert c() == 1\n", "entry_point": "g"},
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.options = {"path": str(path), "format": "code", "eval_fraction": 0.25}
