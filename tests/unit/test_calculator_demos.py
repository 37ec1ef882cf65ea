"""scripts/calculator_demos.py: the tool-using demonstrations an SFT cold start trains on
(docs/sft.md, benchmarks/tool_use.py) read as `forge sft --data` reads them, teach the
call the calculator environment answers, and never show a held-out problem."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from forgerl.sft.rows import Chat, parse_row
from forgerl.tool_calls import parse_tool_calls
from forgerl_plugins.environments.calculator import CalculatorEnvironment
from forgerl_plugins.tasks.arithmetic import ArithmeticTask

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "calculator_demos.py"


def _script():
    spec = importlib.util.spec_from_file_location("calculator_demos", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demonstrations_read_as_sft_rows_and_replay_to_a_full_reward_in_the_environment(tmp_path: Path):
    out = tmp_path / "demos.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), "--count", "40", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40
    task = ArithmeticTask(ArithmeticTask.Options(min_value=100, max_value=999, operations=["*"]))
    held_out = {p.prompt[0]["content"].split("?")[0].removeprefix("What is ") for p in task.eval_problems()}
    for k, row in enumerate(rows):
        chat = parse_row(row, f"demos.jsonl row {k + 1}")
        assert isinstance(chat, Chat)
        question = chat.messages[1]["content"]
        assert question.removeprefix("What is ").rstrip("?") not in held_out
        # Replay what the assistant says through a fresh environment, as an RL run would.
        env = CalculatorEnvironment()
        a, _, b = question.removeprefix("What is ").rstrip("?").split()
        problem = task.problem_at(k)  # row k is training problem k
        assert (problem.metadata["a"], problem.metadata["b"]) == (int(a), int(b))
        env.reset(problem)
        turns = [m["content"] for m in chat.messages if m["role"] == "assistant"]
        [call] = parse_tool_calls(turns[0])
        assert (call.name, call.arguments, call.error) == ("calculate", {"expression": f"{a} * {b}"}, None)
        tool_answer = env.step(turns[0])
        assert tool_answer.messages[0]["content"] == str(int(a) * int(b)) == problem.answer
        verdict = env.step(turns[1])
        assert verdict.done and verdict.reward == 1.0 and verdict.components["used_tool"] == 1.0


def test_rows_offer_the_environments_tool_schema():
    module = _script()
    task = ArithmeticTask(ArithmeticTask.Options(min_value=100, max_value=999, operations=["*"]))
    [row] = list(module.demonstrations(task, 1))
    from forgerl.environment import tool_schemas

    assert row["tools"] == tool_schemas(CalculatorEnvironment)


def test_bad_task_options_are_refused_in_one_line_with_status_2(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--min-value", "50", "--max-value", "10", "--output", str(tmp_path / "x.jsonl")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "max_value" in done.stderr, done.stderr
    assert not (tmp_path / "x.jsonl").exists()
