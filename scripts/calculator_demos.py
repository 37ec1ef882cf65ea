"""Tool-using demonstrations for the ``calculator`` environment, made without a model.

Each row is a conversation in the format ``forge sft --data`` reads (TRL's conversational
``messages`` with ``tools``): the environment's own system and user messages for a training
problem of the ``arithmetic`` task, an assistant turn that calls ``calculate`` on the
problem, the tool's answer as the environment gives it, and a final answer inside the tag.
Every row is played through a real ``calculator`` environment and kept only when it scores
1, so a demonstration teaches exactly the calls and the answer format the environment
reads in an RL run. Problems come from the task's training stream (never its held-out
split), so held-out accuracy after SFT measures what was learned, not what was seen.

    python scripts/calculator_demos.py --count 300 --min-value 100 --max-value 999 \\
        --operations '*' --output calculator-demos.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from forgerl.environment import tool_schemas
from forgerl.errors import ConfigError
from forgerl.sft.rows import call_text
from forgerl.tool_calls import ToolCall
from forgerl_plugins.environments.calculator import CalculatorEnvironment
from forgerl_plugins.tasks.arithmetic import ArithmeticTask


def demonstrations(task: ArithmeticTask, count: int, tag: str = "answer") -> Iterator[dict[str, Any]]:
    """``count`` demonstration rows for the task's training problems 0, 1, ... in order."""
    for index in range(count):
        problem = task.problem_at(index)
        env = CalculatorEnvironment(CalculatorEnvironment.Options(tag=tag))
        messages: list[dict[str, Any]] = list(env.reset(problem))
        meta = problem.metadata
        expression = f"{meta['a']} {meta['op']} {meta['b']}"
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        answered = env.step(call_text("", [ToolCall("calculate", {"expression": expression})]))
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.extend(answered.messages)
        result = answered.messages[0]["content"]
        final = f"{expression} = {result}, so the answer is <{tag}>{result}</{tag}>."
        verdict = env.step(final)
        if not verdict.done or verdict.reward != 1.0:  # the environment would not score it: never teach it
            raise RuntimeError(f"problem {problem.id}: the demonstration scores {verdict.reward}, not 1")
        messages.append({"role": "assistant", "content": final})
        yield {"messages": messages, "tools": tool_schemas(env)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="rows to write (default 300)")
    parser.add_argument("--min-value", type=int, default=100, help="the arithmetic task's min_value")
    parser.add_argument("--max-value", type=int, default=999, help="the arithmetic task's max_value")
    parser.add_argument("--operations", default="*", help="the task's operations, comma-separated (default '*')")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed: which training problems")
    parser.add_argument("--output", type=Path, required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    try:
        options = ArithmeticTask.Options(
            min_value=args.min_value, max_value=args.max_value, operations=args.operations.split(",")
        )
        task = ArithmeticTask(options, seed=args.seed)
    except ValidationError as exc:  # the task's options, refused in one line
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"calculator_demos: {where + ': ' if where else ''}{first['msg']}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"calculator_demos: {exc}", file=sys.stderr)
        return 2
    with args.output.open("w") as out:
        for row in demonstrations(task, args.count):
            out.write(json.dumps(row) + "\n")
    print(f"wrote {args.count} demonstrations to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
