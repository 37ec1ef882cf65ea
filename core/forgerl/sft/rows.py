"""Demonstrations: rows of supervised data, checked and put in one shape.

Three shapes of row are read, TRL's dataset formats:

- conversational: ``{"messages": [...], "tools": [...]}`` (``tools`` optional): system,
  user, assistant and tool messages; an assistant message may carry ``tool_calls``
  (``[{"type": "function", "function": {"name", "arguments"}}]``), each answered by a
  ``tool`` message;
- prompt + completion: ``{"prompt": ..., "completion": ...}``, both strings, or both
  chats (the completion the assistant's turns), or a chat prompt and a string reply;
- text: ``{"text": "..."}``.

A row is hostile input: anything it holds that is not what the format says (a wrong
type, an unknown role or key, roles out of order, a tool message that answers no call,
calls the environment's own parser would not read back, sizes beyond the limits below)
is a :class:`DataError`, one line naming the file, the row and the field. An assistant's
tool calls become the text a model writes to make them (:func:`call_text`), the format
:mod:`forgerl.tool_calls` parses in an environment, so a demonstration teaches exactly the
calls an environment answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from forgerl.errors import ConfigError
from forgerl.tool_calls import MAX_CALL_CHARS, MAX_CALLS_PER_TURN, ToolCall, parse_tool_calls

Message = dict[str, str]
Format = Literal["auto", "messages", "prompt_completion", "text"]

#: Characters of text in one row (all its messages together).
MAX_ROW_CHARS = 1_000_000
#: Messages in one conversation.
MAX_MESSAGES = 1024
#: Tools one row may offer, and the characters of each one's JSON schema.
MAX_TOOLS = 64
MAX_TOOL_SCHEMA_CHARS = 100_000
#: Characters of a tool name (an environment names its answers with at most this many).
MAX_TOOL_NAME = 80

_ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
_FORMAT_FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


class DataError(ConfigError):
    """A row of demonstrations that cannot be trained on: one line naming where and why."""


@dataclass(frozen=True)
class Chat:
    """A conversation: ``messages`` (role and content; a tool message also names its tool;
    an assistant's tool calls are in its content as it would write them), the ``tools``
    offered (JSON schemas), and ``prompt``, how many leading messages are the prompt (what
    a generator would be given; the rest is the assistant's, turn by turn)."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    prompt: int
    where: str
    #: True when the row gave the conversation as prompt + completion (for messages).
    split: bool = False


@dataclass(frozen=True)
class Text:
    """Plain text: a ``prompt`` (empty for a text row) and a ``completion``; ``whole`` for
    a text row (every token is trained on)."""

    prompt: str
    completion: str
    whole: bool
    where: str


Demonstration = Chat | Text


def parse_row(row: Any, where: str, fmt: Format = "auto") -> Demonstration:
    """Row ``row`` (read from ``where``, e.g. ``demos.jsonl row 3``) as a demonstration."""
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row is a JSON object, not {_kind(row)}")
    kind = _format_of(row, where, fmt)
    if kind == "text":
        text = _string(row["text"], where, "text")
        _check_size(len(text), where)
        return Text("", text, True, where)
    if kind == "messages":
        tools = _tools(row.get("tools"), where)
        messages = _messages(row["messages"], where, "messages", tools)
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: messages: no assistant message, so nothing to train on")
        chat = Chat(tuple(messages), tuple(tools), first, where)
        check_order(chat)
        return chat
    return _prompt_completion(row, where)


def _format_of(row: Mapping[str, Any], where: str, fmt: Format) -> str:
    if fmt != "auto":
        missing = [f for f in _FORMAT_FIELDS[fmt] if f not in row]
        if missing:
            raise DataError(f"{where}: no field {missing[0]!r} (sft.format is {fmt}; fields: {_fields(row)})")
        return fmt
    found = [name for name, fields in _FORMAT_FIELDS.items() if all(f in row for f in fields)]
    if len(found) > 1:
        raise DataError(
            f"{where}: has the fields of {' and '.join(found)} rows; set sft.format to say which to train on"
        )
    if not found:
        half = "prompt" if "prompt" in row else "completion" if "completion" in row else None
        if half is not None:
            other = "completion" if half == "prompt" else "prompt"
            raise DataError(f"{where}: has {half!r} but no {other!r} (fields: {_fields(row)})")
        raise DataError(
            f"{where}: not a demonstration: it needs 'messages', 'prompt' and 'completion', or 'text' "
            f"(fields: {_fields(row)})"
        )
    return found[0]


def _prompt_completion(row: Mapping[str, Any], where: str) -> Demonstration:
    prompt, completion = row["prompt"], row["completion"]
    for field, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: {field}: a string or a list of messages, not {_kind(value)}")
    if isinstance(prompt, str) and isinstance(completion, str):
        _check_size(len(prompt) + len(completion), where)
        return Text(prompt, completion, False, where)
    if isinstance(prompt, str):
        raise DataError(
            f"{where}: completion: a chat completion (a list of messages) needs a chat prompt; "
            "give the prompt as messages too, or the completion as a string"
        )
    tools = _tools(row.get("tools"), where)
    before = _messages(prompt, where, "prompt", tools)
    if isinstance(completion, str):
        after: list[Message] = [{"role": "assistant", "content": completion}]
    else:
        after = _messages(completion, where, "completion", tools)
    if after[0]["role"] != "assistant":
        raise DataError(f"{where}: completion[0].role: the completion starts with the assistant, not {after[0]['role']}")
    chat = Chat(tuple(before + after), tuple(tools), len(before), where, split=True)
    _check_size(sum(len(m["content"]) for m in chat.messages), where)
    check_order(chat)
    return chat


# ------------------------------------------------------------------------ messages


def _messages(value: Any, where: str, field: str, tools: Sequence[dict[str, Any]]) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field}: a non-empty list of messages, not {_kind(value)}")
    if len(value) > MAX_MESSAGES:
        raise DataError(f"{where}: {field}: {len(value)} messages; at most {MAX_MESSAGES}")
    names = {t["function"]["name"] for t in tools}
    out: list[Message] = []
    calls: list[tuple[ToolCall, str | None]] = []  # the last assistant turn's, not yet answered
    total = 0
    for i, m in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: {at}: a message is an object with role and content, not {_kind(m)}")
        unknown = sorted(str(k) for k in m if k not in _MESSAGE_KEYS)
        if unknown:
            raise DataError(f"{where}: {at}.{unknown[0]}: unknown key (a message has {', '.join(sorted(_MESSAGE_KEYS))})")
        role = m.get("role")
        if role not in _ROLES:
            raise DataError(f"{where}: {at}.role: {_short(role)} is not one of {', '.join(_ROLES)}")
        if role == "assistant":
            message, calls = _assistant(m, where, at, names)
            out.append(message)
        elif role == "tool":
            out.append(_tool_answer(m, where, at, calls))
            calls = calls[1:]
        else:
            for key in ("tool_calls", "tool_call_id"):
                if m.get(key) is not None:
                    raise DataError(f"{where}: {at}.{key}: only assistant and tool messages have {key}")
            out.append({"role": role, "content": _content(m.get("content"), where, f"{at}.content")})
        total += len(out[-1]["content"])
        _check_size(total, where)
    return out


def _assistant(
    m: Mapping[str, Any], where: str, at: str, names: set[str]
) -> tuple[Message, list[tuple[ToolCall, str | None]]]:
    raw_calls = m.get("tool_calls")
    content = _content(m.get("content"), where, f"{at}.content", empty_ok=raw_calls is not None)
    if m.get("tool_call_id") is not None:
        raise DataError(f"{where}: {at}.tool_call_id: an assistant message makes calls (tool_calls), it answers none")
    if raw_calls is None:
        # Calls written inline, as a model writes them, are the calls of the turn.
        calls = parse_tool_calls(content)
        for k, call in enumerate(calls):
            if call.error is not None:
                raise DataError(f"{where}: {at}.content: <tool_call> {k}: {call.error}")
            _known_tool(call.name, names, where, f"{at}.content")
        return {"role": "assistant", "content": content}, [(c, None) for c in calls]
    if "<tool_call>" in content:
        raise DataError(
            f"{where}: {at}.content: holds a <tool_call> besides tool_calls; give each call once, in tool_calls"
        )
    if not isinstance(raw_calls, list) or not raw_calls:
        raise DataError(f"{where}: {at}.tool_calls: a non-empty list of calls, not {_kind(raw_calls)}")
    if len(raw_calls) > MAX_CALLS_PER_TURN:
        raise DataError(
            f"{where}: {at}.tool_calls: {len(raw_calls)} calls; an environment answers at most {MAX_CALLS_PER_TURN} a turn"
        )
    parsed = [_call(c, where, f"{at}.tool_calls[{k}]", names) for k, c in enumerate(raw_calls)]
    text = call_text(content, [c for c, _ in parsed])
    back = parse_tool_calls(text)
    if [(c.name, c.arguments, c.error) for c in back] != [(c.name, c.arguments, None) for c, _ in parsed]:
        raise DataError(f"{where}: {at}.tool_calls: the calls do not read back as written (a name or argument holds "
                        "</tool_call>?)")
    return {"role": "assistant", "content": text}, parsed


def _call(value: Any, where: str, at: str, names: set[str]) -> tuple[ToolCall, str | None]:
    if not isinstance(value, Mapping):
        raise DataError(f"{where}: {at}: a call is an object {{\"type\": \"function\", \"function\": {{...}}}}, "
                        f"not {_kind(value)}")
    call_id = value.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise DataError(f"{where}: {at}.id: a string, not {_kind(call_id)}")
    function = value.get("function", value)
    if not isinstance(function, Mapping):
        raise DataError(f"{where}: {at}.function: an object with name and arguments, not {_kind(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME:
        raise DataError(f"{where}: {at}.function.name: a tool name of 1 to {MAX_TOOL_NAME} characters, not {_short(name)}")
    _known_tool(name, names, where, f"{at}.function.name")
    # The OpenAI wire format sends the arguments as a JSON string.
    arguments = _unquoted(function.get("arguments", {}), where, f"{at}.function.arguments")
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: {at}.function.arguments: a JSON object, not {_kind(arguments)}")
    try:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise DataError(f"{where}: {at}.function.arguments: cannot be written as JSON ({type(exc).__name__})") from None
    if len(body) > MAX_CALL_CHARS:
        raise DataError(
            f"{where}: {at}: the call is {len(body)} characters of JSON; an environment refuses calls over {MAX_CALL_CHARS}"
        )
    return ToolCall(name, arguments), call_id


def _known_tool(name: str, names: set[str], where: str, at: str) -> None:
    if names and name not in names:
        raise DataError(f"{where}: {at}: calls {name[:MAX_TOOL_NAME]!r}, which the row's tools do not offer "
                        f"({', '.join(sorted(names))})")


def _tool_answer(m: Mapping[str, Any], where: str, at: str, calls: list[tuple[ToolCall, str | None]]) -> Message:
    if not calls:
        raise DataError(f"{where}: {at}: a tool message answers a call, and no call of the assistant's is left to answer")
    call, call_id = calls[0]
    if m.get("tool_calls") is not None:
        raise DataError(f"{where}: {at}.tool_calls: only assistant messages make calls")
    given_id = m.get("tool_call_id")
    if given_id is not None and call_id is not None and given_id != call_id:
        raise DataError(
            f"{where}: {at}.tool_call_id: {_short(given_id)}, but the call it answers (calls are answered in order) "
            f"has id {call_id!r}"
        )
    name = m.get("name")
    if name is not None and name != call.name:
        raise DataError(f"{where}: {at}.name: {_short(name)}, but the call it answers is to {call.name!r}")
    # An environment names each answer after its call (forgerl.tool_calls.answer_tool_calls).
    return {"role": "tool", "name": call.name, "content": _content(m.get("content"), where, f"{at}.content")}


def call_text(content: str, calls: Sequence[ToolCall]) -> str:
    """What the assistant writes to make ``calls`` after ``content``: one
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per line, the format
    :func:`forgerl.tool_calls.parse_tool_calls` reads."""
    lines = [
        "<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + "</tool_call>"
        for c in calls
    ]
    if not content:
        return "\n".join(lines)
    return content + ("" if content.endswith("\n") else "\n") + "\n".join(lines)


def _content(value: Any, where: str, at: str, *, empty_ok: bool = False) -> str:
    if value is None and empty_ok:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        texts = []
        for k, part in enumerate(value):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise DataError(f"{where}: {at}[{k}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are read, "
                                f"not {_short(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise DataError(f"{where}: {at}: a string, not {_kind(value)}")


def _unquoted(value: Any, where: str, field: str) -> Any:
    """``value``, or what it holds when it is a string of JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise DataError(f"{where}: {field}: a string that is not JSON") from None


def _string(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {field}: a string, not {_kind(value)}")
    return value


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    value = _unquoted(value, where, "tools")  # Parquet files often keep the schemas as one JSON string
    if not isinstance(value, list):
        raise DataError(f"{where}: tools: a list of tool schemas, not {_kind(value)}")
    if len(value) > MAX_TOOLS:
        raise DataError(f"{where}: tools: {len(value)} tools; at most {MAX_TOOLS}")
    out = []
    for k, tool in enumerate(value):
        at = f"tools[{k}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not (isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(function, Mapping)):
            raise DataError(f"{where}: {at}: a tool is {{\"type\": \"function\", \"function\": {{\"name\", "
                            f"\"description\", \"parameters\"}}}}, not {_short(tool)}")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME:
            raise DataError(f"{where}: {at}.function.name: a name of 1 to {MAX_TOOL_NAME} characters, not {_short(name)}")
        try:
            size = len(json.dumps(tool))
        except (ValueError, TypeError, RecursionError) as exc:
            raise DataError(f"{where}: {at}: not plain JSON ({type(exc).__name__})") from None
        if size > MAX_TOOL_SCHEMA_CHARS:
            raise DataError(f"{where}: {at}: the schema is {size} characters; at most {MAX_TOOL_SCHEMA_CHARS}")
        out.append(json.loads(json.dumps(tool)))  # a plain, independent copy
    return out


# --------------------------------------------------------------------------- order


def check_order(chat: Chat) -> None:
    """The roles of ``chat`` follow each other as in an environment's trajectory: a system
    message first if any, then a user message; an assistant turn that makes calls is
    followed by one tool message per call (or ends the conversation); no two assistant
    turns in a row; the conversation ends with the assistant."""
    messages, where = chat.messages, chat.where
    pending = 0  # calls of the last assistant turn not yet answered
    for i, m in enumerate(messages):
        role, at = m["role"], _place(chat, i)
        if role == "system" and i != 0:
            raise DataError(f"{where}: {at}.role: a system message comes first or not at all")
        if i == (1 if messages[0]["role"] == "system" else 0) and role != "user":
            raise DataError(f"{where}: {at}.role: the conversation starts with a user message (after an optional "
                            f"system message), not {role}")
        if pending and role != "tool":
            raise DataError(f"{where}: {at}.role: {pending} tool call(s) of the assistant are not answered before this "
                            f"{role} message")
        if role == "assistant":
            if i > 0 and messages[i - 1]["role"] == "assistant":
                raise DataError(f"{where}: {at}.role: two assistant turns in a row; a user or tool message comes between")
            pending = len(parse_tool_calls(m["content"]))
        elif role == "tool":
            pending -= 1
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: {_place(chat, len(messages) - 1)}: the conversation ends with a {messages[-1]['role']} "
                        "message; a demonstration ends with the assistant's turn")


def _place(chat: Chat, i: int) -> str:
    """Where message ``i`` was in the row: ``messages[i]``, or ``prompt[i]`` / ``completion[j]``."""
    if chat.split:
        return f"prompt[{i}]" if i < chat.prompt else f"completion[{i - chat.prompt}]"
    return f"messages[{i}]"


# --------------------------------------------------------------------------- helpers


def _check_size(chars: int, where: str) -> None:
    if chars > MAX_ROW_CHARS:
        raise DataError(f"{where}: {chars} characters of text; at most {MAX_ROW_CHARS} in one row")


def _fields(row: Mapping[str, Any]) -> str:
    names = [str(k)[:40] for k in list(row)[:12]]
    return ", ".join(names) + (", ..." if len(row) > 12 else "") if names else "none"


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
