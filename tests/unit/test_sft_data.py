"""Rows of supervised data (forgerl.sft.rows, forgerl.sft.files): each format read into one
shape, and every hostile row refused in one line that names the file, the row and the
field, before anything starts (`forge sft` exits 2 and creates nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.configuration.sft import SFTConfig
from forgerl.sft.data import check_files
from forgerl.sft.files import MAX_LINE_BYTES
from forgerl.sft.rows import MAX_MESSAGES, Chat, DataError, Text, parse_row
from forgerl.tool_calls import parse_tool_calls
from tests.helpers.timing import scaled

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Compute.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


def call(expression: str = "17 * 23", name: str = "calculate", **extra) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"expression": expression}}, **extra}


def tool_chat(**assistant) -> dict:
    """A calculator conversation: one call, its answer, the final answer."""
    first = {"role": "assistant", "tool_calls": [call()], **assistant}
    return {"messages": [
        {"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 17 * 23?"},
        first, {"role": "tool", "content": "391"}, {"role": "assistant", "content": "<answer>391</answer>"},
    ], "tools": TOOLS}  # fmt: skip


# ------------------------------------------------------------------------ formats


def test_a_tool_conversation_is_read_as_the_calls_a_model_writes():
    demo = parse_row(tool_chat(), "demos.jsonl line 1")
    assert isinstance(demo, Chat) and demo.prompt == 2 and not demo.split
    roles = [m["role"] for m in demo.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    calls = parse_tool_calls(demo.messages[2]["content"])  # the environments' own parser
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculate", {"expression": "17 * 23"}, None)]
    # An environment names each answer after the call it answers.
    assert demo.messages[3] == {"role": "tool", "name": "calculate", "content": "391"}
    assert demo.tools == tuple(TOOLS)


def test_arguments_as_a_json_string_content_beside_calls_and_inline_calls():
    openai = tool_chat(content="Let me compute.")
    openai["messages"][2]["tool_calls"] = [
        {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "17 * 23"}'}}
    ]
    openai["messages"][3]["tool_call_id"] = "c1"
    text = parse_row(openai, "w").messages[2]["content"]
    assert text.startswith("Let me compute.\n<tool_call>")
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("calculate", {"expression": "17 * 23"})]
    inline = tool_chat()
    inline["messages"][2] = {"role": "assistant", "content": text}  # written as a model writes them
    assert parse_row(inline, "w").messages == parse_row(openai, "w").messages


def test_prompt_completion_shapes():
    text = parse_row({"prompt": "2 + 2 =", "completion": " 4"}, "w")
    assert text == Text("2 + 2 =", " 4", False, "w")
    chat = parse_row({"prompt": [{"role": "user", "content": "2 + 2?"}], "completion": "4"}, "w")
    assert isinstance(chat, Chat) and chat.prompt == 1 and chat.split
    assert chat.messages[1] == {"role": "assistant", "content": "4"}
    turns = parse_row({"prompt": [{"role": "user", "content": "17 * 23?"}],
                       "completion": tool_chat()["messages"][2:], "tools": TOOLS}, "w")  # fmt: skip
    assert isinstance(turns, Chat) and turns.prompt == 1 and len(turns.messages) == 4
    assert parse_row({"text": "plain words"}, "w") == Text("", "plain words", True, "w")


def test_content_parts_and_extra_row_fields():
    row = {"id": 7, "source": "x", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}]}  # fmt: skip
    assert parse_row(row, "w").messages[0]["content"] == "ab"


# ------------------------------------------------------------------- hostile rows

HOSTILE = {
    "not an object": ([1, 2], "a row is a JSON object"),
    "no format": ({"question": "q", "answer": "a"}, "needs 'messages', 'prompt' and 'completion', or 'text'"),
    "half a pair": ({"prompt": "q"}, "has 'prompt' but no 'completion'"),
    "two formats": ({"text": "t", "messages": []}, "set sft.format"),
    "text not a string": ({"text": {"nested": ["x"]}}, "text: a string, not an object"),
    "messages not a list": ({"messages": "hi"}, "messages: a non-empty list of messages, not a string"),
    "unknown role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: 'robot' is not one of"),
    "unknown key": ({"messages": [{"role": "user", "content": "x", "thinking": "y"}]}, "messages[0].thinking: unknown key"),
    "content of a wrong type": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: a string, not a number"),
    "no assistant": ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    "assistant first": ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role: the conversation starts with a user"),
    "system later": ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"},
                                   {"role": "assistant", "content": "y"}]}, "messages[1].role: a system message comes first"),
    "two assistants": ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
                                     {"role": "assistant", "content": "b"}]}, "messages[2].role: two assistant turns"),
    "ends with user": ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
                                     {"role": "user", "content": "y"}]}, "ends with a user message"),
    "tool without a call": ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
                                          {"role": "tool", "content": "3"}]}, "messages[2]: a tool message answers a call"),
    "unanswered call": ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call()]},
                                      {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]},
                        "messages[2].role: 1 tool call(s) of the assistant are not answered"),
    "content and tool_calls both call": (tool_chat(content='<tool_call>{"name": "calculate"}</tool_call>'),
                                         "messages[2].content: holds a <tool_call> besides tool_calls"),
    "malformed inline call": ({"messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "<tool_call>{not json</tool_call>"}]},
                              "messages[1].content: <tool_call> 0: tool call is not valid JSON"),
    "call to an unoffered tool": (tool_chat(tool_calls=[call(name="shell")]), "calls 'shell', which the row's tools do not offer"),
    "arguments not an object": (tool_chat(tool_calls=[{"type": "function", "function": {"name": "calculate", "arguments": [1]}}]),
                                "messages[2].tool_calls[0].function.arguments: a JSON object, not a list"),
    "huge call": (tool_chat(tool_calls=[call(expression="1+" * 5000 + "1")]), "an environment refuses calls over 8000"),
    "too many calls": (tool_chat(tool_calls=[call()] * 9), "9 calls; an environment answers at most 8"),
    "tool answers another": ({**tool_chat(), "messages": [*tool_chat()["messages"][:3],
                                                            {"role": "tool", "name": "other", "content": "1"},
                                                            tool_chat()["messages"][4]]},
                             "messages[3].name: 'other', but the call it answers is to 'calculate'"),
    "tools not a list": ({"messages": tool_chat()["messages"], "tools": {"a": 1}}, "tools: a list of tool schemas"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]},
                                 {"role": "assistant", "content": "a"}]}, "messages[0].content[0]: only text parts"),
    "completion starts with the user": ({"prompt": [{"role": "user", "content": "x"}],
                                         "completion": [{"role": "user", "content": "y"}]},
                                        "completion[0].role: the completion starts with the assistant"),
    "string prompt, chat completion": ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]},
                                       "completion: a chat completion (a list of messages) needs a chat prompt"),
    "too many messages": ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)},
                          f"{MAX_MESSAGES + 1} messages; at most {MAX_MESSAGES}"),
    "too much text": ({"text": "x" * 1_000_001}, "1000001 characters of text; at most 1000000"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_row_is_one_line_naming_the_row_and_field(case):
    row, expected = HOSTILE[case]
    with pytest.raises(DataError) as caught:
        parse_row(row, "demos.jsonl line 9")
    message = str(caught.value)
    assert message.startswith("demos.jsonl line 9: ") and "\n" not in message, message
    assert expected in message, message


def test_deeply_nested_arguments_are_refused_not_a_crash():
    deep: object = "x"
    for _ in range(5000):
        deep = {"a": deep}
    row = tool_chat(tool_calls=[{"type": "function", "function": {"name": "calculate", "arguments": deep}}])
    with pytest.raises(DataError, match="cannot be written as JSON"):
        parse_row(row, "w")


# --------------------------------------------------------------------------- files


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_files_name_the_line_of_a_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "demos.jsonl", [{"text": "a"}, "", {"text": "b"}, "{nope", {"text": "c"}])
    with pytest.raises(DataError, match=rf"^{tmp_path}/demos.jsonl line 4: not valid JSON"):
        check_files(SFTConfig(data=[str(path)]))
    nested = write_jsonl(tmp_path / "nested.jsonl", ["[" * 100_000 + "]" * 100_000])
    with pytest.raises(DataError, match="line 1: JSON nested too deeply"):
        check_files(SFTConfig(data=[str(nested)]))
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"text": "x" * (MAX_LINE_BYTES + 10)}) + "\n")
    with pytest.raises(DataError, match=f"line 1: longer than {MAX_LINE_BYTES} bytes"):
        check_files(SFTConfig(data=[str(huge)]))
    with pytest.raises(DataError, match="does not exist"):
        check_files(SFTConfig(data=[str(tmp_path / "missing.jsonl")]))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        check_files(SFTConfig(data=[str(tmp_path / "empty.jsonl")]))


def test_parquet_rows_are_read_and_named_by_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "demos.parquet")
    with pytest.raises(DataError, match=r"demos.parquet row 2: completion: a string or a list of messages, not null"):
        check_files(SFTConfig(data=[str(tmp_path / "demos.parquet")]))
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "good.parquet")
    check_files(SFTConfig(data=[str(tmp_path / "good.parquet")]))


# ------------------------------------------------------------------------ the CLI


def test_forge_sft_refuses_a_hostile_file_before_anything_starts(tmp_path):
    bad = write_jsonl(tmp_path / "demos.jsonl", [tool_chat(), {"messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "content": "3"}, {"role": "assistant", "content": "y"}]}])
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "sft", "--data", str(bad), "--model", "tiny", "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=scaled(120),
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == (f"forge: error: {bad} line 2: messages[1]: a tool message answers a call, and no call of "
                        "the assistant's is left to answer"), lines[0]
    assert not out.exists(), "a refused run must leave nothing behind"


def test_sft_without_demonstrations_is_refused_by_the_config():
    from forgerl.configuration.config import build_config
    from forgerl.errors import ConfigError

    with pytest.raises(ConfigError, match="objective sft needs demonstrations"):
        build_config(sets=["objective=sft"])
    with pytest.raises(ConfigError, match="not both"):
        build_config(sets=["objective=sft", "sft.data=[a.jsonl]", "sft.task_demonstrations=true"])
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):
        build_config(sets=["objective=sft", "sft.data=[a.jsonl]", "algorithm.kl_coef=0.1"])
