"""Tools of environments: JSON schemas from signatures and docstrings, tool calls parsed
from hostile model text (never executed when malformed), and the calculator's tool, which
computes arithmetic without running the model's text."""

from __future__ import annotations

import json
import time

import pytest

from forgerl.environment import Environment, Step, tool, tool_schemas
from forgerl.tool_calls import MAX_CALL_CHARS, MAX_CALLS_PER_TURN, answer_tool_calls, parse_tool_calls
from forgerl.types import Problem


class Tools(Environment):
    def __init__(self) -> None:
        self.ran: list[tuple[str, dict]] = []

    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": "hi"}]

    @tool
    def add(self, a: int, b: int = 2) -> int:
        """Add two integers.

        Longer explanation that is not the description.

        Args:
            a: the first one
            b: the second one
        """
        self.ran.append(("add", {"a": a, "b": b}))
        return a + b

    @tool
    def shout(self, words: list[str], loud: bool, scale: float) -> str:
        """Join words."""
        self.ran.append(("shout", {"words": words}))
        return " ".join(words).upper()

    def not_a_tool(self) -> None:
        raise AssertionError("only @tool methods may be called")


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_schemas_come_from_signature_and_docstring():
    add, shout = tool_schemas(Tools)
    assert add == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first one"},
                    "b": {"type": "integer", "description": "the second one"},
                },
                "required": ["a"],
            },
        },
    }
    params = shout["function"]["parameters"]
    assert params["properties"] == {
        "words": {"type": "array", "items": {"type": "string"}},
        "loud": {"type": "boolean"},
        "scale": {"type": "number"},
    }
    assert params["required"] == ["words", "loud", "scale"]
    assert list(Tools.tool_methods()) == ["add", "shout"], "only methods marked @tool are tools"


def test_a_tool_without_types_is_refused_when_described():
    class Untyped(Tools):
        @tool
        def bad(self, x):  # type: ignore[no-untyped-def]
            """No annotation."""

    with pytest.raises(TypeError, match="no type annotation"):
        tool_schemas(Untyped)


def test_a_well_formed_call_runs_the_tool():
    env = Tools()
    messages = env.step("let me add " + call("add", a=3, b=4) + " and " + call("shout", words=["a", "b"], loud=True, scale=1))
    assert isinstance(messages, Step) and not messages.done
    assert [m["content"] for m in messages.messages] == ["7", "A B"]
    assert all(m["role"] == "tool" for m in messages.messages)
    assert env.step("no calls here").done, "a turn without calls is the answer"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"name": 5}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}', "unterminated"),
        (call("rm_rf", path="/"), "unknown tool 'rm_rf'"),
        (call("not_a_tool"), "unknown tool 'not_a_tool'"),
        (call("__init__"), "unknown tool"),
        (call("add", a="3"), "a: Input should be a valid integer"),
        (call("add", a=1.5), "a: Input should be a valid integer"),
        (call("add"), "a: Field required"),
        (call("add", a=1, c=2), "c: Extra inputs are not permitted"),
        (call("shout", words="ab", loud=1, scale=1), "words"),
        ("<tool_call>" + json.dumps({"name": "add", "arguments": {"a": 1, "pad": "x" * MAX_CALL_CHARS}}) + "</tool_call>",
         "too long"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "too long"),
        ("<tool_call>" + "[" * 3000 + "]" * 3000 + "</tool_call>", "not valid JSON"),
    ],
)
def test_malformed_calls_are_answered_with_an_error_and_never_run(text, error):
    env = Tools()
    step = env.step(text)
    assert not step.done, "a malformed call is answered, not taken as the final answer"
    (message,) = step.messages
    assert message["role"] == "tool" and message["content"].startswith("error: "), message
    assert error in message["content"], message["content"]
    assert env.ran == [], f"a malformed call ran a tool: {env.ran}"


def test_too_many_calls_in_one_turn_are_cut():
    calls = parse_tool_calls(call("add", a=1) * (MAX_CALLS_PER_TURN + 5))
    assert len(calls) == MAX_CALLS_PER_TURN + 1
    assert calls[-1].error is not None and "too many" in calls[-1].error
    messages = answer_tool_calls(Tools(), calls)
    assert [m["content"] for m in messages[:-1]] == ["3"] * MAX_CALLS_PER_TURN


def test_huge_results_are_truncated():
    class Big(Tools):
        @tool
        def big(self) -> str:
            """A lot."""
            return "x" * 1_000_000

    (message,) = Big().step(call("big")).messages
    assert len(message["content"]) < 5000 and message["content"].endswith("(truncated)")


# ----------------------------------------------------------------- calculator


@pytest.fixture
def calculate():
    from forgerl_plugins.environments.calculator import CalculatorEnvironment

    env = CalculatorEnvironment()
    env.reset(Problem("p", "What is 2 + 2?", "4", {"a": 2, "op": "+", "b": 2}))

    def run(expression: object) -> str:
        (message,) = env.step(f"<tool_call>{json.dumps({'name': 'calculate', 'arguments': {'expression': expression}})}</tool_call>").messages
        return message["content"]

    return run


@pytest.mark.parametrize(
    ("expression", "value"),
    [("17 * 23", "391"), ("(17 + 25) * 3", "126"), ("7 / 2", "3.5"), ("-3 - -4", "1"), ("2 ** 10", "1024"),
     ("2 ^ 3", "8"), ("1.5 * 2", "3"), ("10 / 3", "3.333333333")],
)
def test_calculator_computes(calculate, expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('touch /tmp/forge-pwned')",
        "open('/etc/passwd').read()",
        "(lambda: 1)()",
        "[x for x in ().__class__.__base__.__subclasses__()]",
        "9 ** 9 ** 9",
        "2 ** 100000",
        "10 ** 70",
        "1 / 0",
        "0 ** -1",
        "1e308 * 10",
        "x + 1",
        "'a' * 3",
        "1 if 1 else 2",
        "(" * 300 + "1" + ")" * 300,
        "",
        "1; 2",
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(calculate, expression, tmp_path):
    started = time.perf_counter()
    answer = calculate(expression)
    assert answer.startswith("error: "), f"{expression!r} was computed: {answer[:100]}"
    assert time.perf_counter() - started < 1.0, f"{expression!r} took too long to refuse"


def test_calculator_never_evaluates_code(calculate, tmp_path):
    marker = tmp_path / "pwned"
    calculate(f"__import__('pathlib').Path({str(marker)!r}).touch()")
    assert not marker.exists()


def test_calculator_answer_is_scored_against_the_problem():
    from forgerl_plugins.environments.calculator import CalculatorEnvironment

    env = CalculatorEnvironment()
    messages = env.reset(Problem("p", [{"role": "user", "content": "x"}], "42", {"a": 17, "op": "+", "b": 25}))
    assert messages[-1] == {"role": "user", "content": "What is 17 + 25?"}
    right = env.step("so <answer>42</answer>")
    assert right.done and right.reward == 1.0 and right.components["correct"] == 1.0
    env2 = CalculatorEnvironment()
    env2.reset(Problem("p", "What is 17 + 25?", "42"))
    assert env2.step("<answer>41</answer>").reward == 0.0


def test_guess_counts_the_hints_the_model_followed():
    """``followed`` counts the answers that went the way the last higher/lower hint said;
    an answer without a number gets no hint, so the next number follows nothing."""
    from forgerl_plugins.environments.guess import GuessEnvironment

    env = GuessEnvironment(GuessEnvironment.Options(low=1, high=8, max_guesses=6))
    env.reset(Problem("game-7", ""))
    secret = env.secret
    low = 1 if secret != 1 else 8  # a wrong guess, and the hint it gets
    says = "Higher." if low < secret else "Lower."
    assert env.step(str(low)).messages[0]["content"] == says
    env.step(str(low))  # the same number again: the hint not followed
    env.step("no idea")  # no number: no hint to follow next
    wrong_way = 0 if says == "Higher." else 9  # against the hint (and out of range)
    env.step(str(low))
    env.step(str(wrong_way))
    won = env.step(f"It is {secret}.")
    assert won.done and won.reward == 1.0 and won.components["first_guess"] == 0.0
    # Hints answered with a number: guesses 2, 5 and 6 (guess 4 came after the number-less
    # answer). Followed: only the winning guess, the hinted way from the wrong-way guess.
    assert won.components["hints"] == 3.0
    assert won.components["followed"] == 1.0
    first = GuessEnvironment(GuessEnvironment.Options(low=1, high=8, max_guesses=3))
    first.reset(Problem("game-7", ""))
    assert first.step(str(secret)).components == {
        "correct": 1.0, "guesses": 1.0, "first_guess": 1.0, "hints": 0.0, "followed": 0.0
    }


def test_guess_gives_feedback_then_a_reward():
    from forgerl_plugins.environments.guess import GuessEnvironment

    env = GuessEnvironment(GuessEnvironment.Options(low=1, high=16, max_guesses=6))
    env.reset(Problem("game-1", ""))
    lo, hi, turns = 1, 16, 0
    while True:  # bisection finds it in at most 5 guesses
        guess = (lo + hi) // 2
        step = env.step(f"I guess {guess}")
        turns += 1
        if step.done:
            break
        hint = step.messages[0]["content"]
        lo, hi = (guess + 1, hi) if hint == "Higher." else (lo, guess - 1)
    assert step.reward == 1.0 and step.components["guesses"] == turns <= 5
    # Bisection follows every hint; a win on the first guess would need no feedback.
    assert step.components["hints"] == step.components["followed"] == turns - 1
    assert step.components["first_guess"] == float(turns == 1)
    lost = GuessEnvironment(GuessEnvironment.Options(low=1, high=16, max_guesses=1))
    lost.reset(Problem("game-1", ""))
    final = lost.step(str(0))
    assert final.done and final.reward == 0.0
