"""Demonstrations rendered to tokens (forgerl.sft.render): a tool-using conversation gives,
token for token, the ids and loss mask of the calculator environment's trajectory in
which the model wrote the same turns; a single-turn prompt is the RL loop's prompt; the
loss mask covers what the assistant says (or everything); long rows are truncated or
left out. Against the tiny model's tokenizer (no model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from forgerl.environment import tool_schemas
from forgerl.rollouts.rollout import Tokenizing
from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
from forgerl.sft.render import Renderer
from forgerl.sft.rows import Chat, parse_row
from forgerl.testing.environment_support import ScriptedGenerator
from forgerl.types import Problem, SamplingParams
from forgerl_plugins.environments.calculator import CalculatorEnvironment
from forgerl_plugins.tasks.arithmetic import ArithmeticTask

# A template that renders tools itself, and tool answers in tags (as Qwen2.5's does).
TEMPLATE_WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (tools and loop.first and m['role'] == 'system') %}"
    "{%- if m['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PROBLEM = Problem(id="p", prompt="What is 17 * 23?", answer="391", metadata={"a": 17, "op": "*", "b": 23})


@pytest.fixture(scope="module", params=["tools in the system prompt", "tools in the template"])
def tokenizer(request: pytest.FixtureRequest, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "tools in the template":
        tok.chat_template = TEMPLATE_WITH_TOOLS
    return tok


def calculator_demo() -> dict:
    """The calculator environment's conversation for PROBLEM, the tool's answers its own:
    two calls in one turn, one more in the next, then the answer."""
    env = CalculatorEnvironment()
    calls = [[("calculate", "17 * 20"), ("calculate", "17 * 3")], [("calculate", "340 + 51")]]
    messages = list(env.reset(PROBLEM))
    for turn in calls:
        messages.append({"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": {"expression": e}}} for n, e in turn]})
        messages += [{"role": "tool", "content": env.calculate(e)} for _, e in turn]
    messages.append({"role": "assistant", "content": "17 * 23 = 391. <answer>391</answer>"})
    return {"messages": messages, "tools": tool_schemas(CalculatorEnvironment)}


def test_a_tool_demonstration_is_token_exact_with_the_calculator_trajectory(tokenizer):
    demo = parse_row(calculator_demo(), "demos.jsonl line 1")
    assert isinstance(demo, Chat)
    rendered = Renderer(tokenizer, max_length=100_000).render(demo)
    assert rendered.outcome == "kept" and rendered.example is not None
    # The environment's trajectory in which the model writes the demonstration's turns.
    turns = [m["content"] for m in demo.messages if m["role"] == "assistant"]
    runner = TrajectoryRunner(
        lambda: CalculatorEnvironment(), CalculatorEnvironment, tokenizer,
        Limits(max_turns=8, max_total_tokens=100_000, max_turn_tokens=10_000), SamplingParams(),
    )  # fmt: skip
    (trajectory,), _ = asyncio.run(runner.run_many(ScriptedGenerator(tokenizer, {"job": turns}), [(PROBLEM, "job", 0)]))
    assert trajectory.failure is None and trajectory.turns == 3
    assert trajectory.reward == 1.0 and trajectory.components["used_tool"] == 1.0, trajectory.components
    expected_ids = trajectory.prompt_ids + trajectory.completion.token_ids
    expected_mask = [0] * len(trajectory.prompt_ids) + list(trajectory.completion.mask or [])
    ex = rendered.example
    assert ex.input_ids == expected_ids, (tokenizer.decode(ex.input_ids), tokenizer.decode(expected_ids))
    assert ex.loss_mask == expected_mask
    trained = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert "391<|im_end|>" not in trained.split("<answer>")[0], "a tool's answer is in the loss"
    assert trained.count("<tool_call>") == 3 and trained.endswith("<answer>391</answer><|im_end|>")


def test_a_single_turn_chat_prompt_is_the_rl_loops_prompt(tokenizer):
    task = ArithmeticTask(ArithmeticTask.Options(), seed=0)
    problem = task.next_problems(1)[0]
    answer = task.demonstration(problem)
    assert answer is not None
    ex = Renderer(tokenizer).render(parse_row({"prompt": problem.prompt, "completion": answer}, "w")).example
    assert ex is not None
    prompt = Tokenizing(tokenizer).prompt_ids(problem)
    assert ex.input_ids[: len(prompt)] == prompt and not any(ex.loss_mask[: len(prompt)])
    completion = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert ex.input_ids[len(prompt):] == completion and all(ex.loss_mask[len(prompt):])


def test_the_arithmetic_tasks_worked_answers_are_right():
    from forgerl.types import RewardInput
    from forgerl_plugins.rewards.math_answer import MathAnswerReward

    task = ArithmeticTask(ArithmeticTask.Options(operations=["+", "-", "*"], max_value=99), seed=3)
    reward = MathAnswerReward(MathAnswerReward.Options())
    for problem in task.next_problems(20):
        answer = task.demonstration(problem)
        assert answer is not None
        result = reward.score(RewardInput(problem, answer))
        assert result.components["correct"] == 1.0, (problem.prompt, answer, result)  # type: ignore[union-attr]
    assert ArithmeticTask.gives_demonstrations()


def test_loss_masks_of_each_shape(tokenizer):
    eos = tokenizer.eos_token_id
    text = Renderer(tokenizer).render(parse_row({"text": "the answer is"}, "w")).example
    assert text is not None and text.input_ids[-1] == eos and all(text.loss_mask)
    pair = Renderer(tokenizer).render(parse_row({"prompt": "2 + 2 =", "completion": " 4"}, "w")).example
    prompt = list(tokenizer("2 + 2 =")["input_ids"])
    assert pair is not None and pair.input_ids[: len(prompt)] == prompt
    assert pair.loss_mask == [0] * len(prompt) + [1] * (len(pair.input_ids) - len(prompt))
    chat = parse_row(calculator_demo(), "w")
    everything = Renderer(tokenizer, loss_on="all", max_length=100_000).render(chat).example
    assert everything is not None and all(everything.loss_mask)
    only = Renderer(tokenizer, max_length=100_000).render(chat).example
    assert only is not None and only.input_ids == everything.input_ids and 0 < sum(only.loss_mask) < len(only.loss_mask)


def test_long_demonstrations_are_truncated_or_left_out(tokenizer):
    long = parse_row({"prompt": "What is 2 + 2?", "completion": " four" * 40}, "w")
    prompt = len(tokenizer("What is 2 + 2?")["input_ids"])
    cut = Renderer(tokenizer, max_length=prompt + 5).render(long)
    assert cut.outcome == "truncated" and cut.example is not None
    assert len(cut.example.input_ids) == prompt + 5 and sum(cut.example.loss_mask) == 5
    assert Renderer(tokenizer, max_length=prompt + 5, overlong="drop").render(long).outcome == "too_long"
    prompt_only = Renderer(tokenizer, max_length=prompt).render(long)
    assert prompt_only.outcome == "nothing_to_train" and prompt_only.example is None
