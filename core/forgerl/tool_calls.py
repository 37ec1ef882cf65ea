"""Tool calls in an assistant turn, and their answers.

The default format (what Qwen/Hermes-style chat templates teach their models) is one JSON
object per call between tags::

    <tool_call>{"name": "calculate", "arguments": {"expression": "17 * 23"}}</tool_call>

Everything here treats the model's text as hostile: a call that is not JSON, names no
known tool, passes arguments of the wrong type or is too large is answered with an error
message the model can read (its trajectory goes on), never executed. Arguments are
validated against the tool's signature before the tool runs.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Not importing forgerl.environment (it imports this module): an environment here is any
# object whose class has ``tool_methods()``, a message a chat-message dict.
Message = dict[str, Any]

#: Calls answered per turn; more are answered with an error (a model looping on calls).
MAX_CALLS_PER_TURN = 8
#: Characters of one call's JSON: larger ones are refused before json.loads sees them.
MAX_CALL_CHARS = 8_000
#: Characters of a tool's answer kept in the conversation.
MAX_RESULT_CHARS = 4_000

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``error`` set when it cannot be made (the model reads it)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in ``text``, in order; malformed ones carry an ``error``."""
    calls: list[ToolCall] = []
    for match in _CALL.finditer(text):
        if len(calls) == MAX_CALLS_PER_TURN:
            calls.append(ToolCall("", {}, f"too many tool calls in one turn (at most {MAX_CALLS_PER_TURN})"))
            break
        calls.append(_parse_one(match.group(1), closed=match.group(0).endswith("</tool_call>")))
    return calls


def split_tool_calls(
    text: str, accept: Callable[[ToolCall], bool] | None = None
) -> tuple[str, list[ToolCall]]:
    """``text`` without its well-formed calls, and those calls in order (at most
    :data:`MAX_CALLS_PER_TURN`). A malformed call stays in the text, where the reader sees
    what the model wrote, and so does one ``accept`` refuses (arguments that break a strict
    schema). For answers in the OpenAI format (``message.tool_calls``)."""
    kept: list[str] = []
    calls: list[ToolCall] = []
    at = 0
    for match in _CALL.finditer(text):
        call = _parse_one(match.group(1), closed=match.group(0).endswith("</tool_call>"))
        if call.error is not None or len(calls) == MAX_CALLS_PER_TURN or (accept is not None and not accept(call)):
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    return "".join(kept), calls


def _parse_one(body: str, *, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall("", {}, "unterminated <tool_call>: close it with </tool_call>")
    if len(body) > MAX_CALL_CHARS:
        return ToolCall("", {}, f"tool call too long ({len(body)} characters, at most {MAX_CALL_CHARS})")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCall("", {}, f"tool call is not valid JSON: {str(exc)[:200]}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, "arguments must be a JSON object")
    return ToolCall(data["name"], arguments)


def _check_arguments(method: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` checked against the tool's typed signature: strict types (no "3" for
    an int), no unknown or missing ones. Raises ValueError with what is wrong."""
    from pydantic import ConfigDict, ValidationError, create_model

    hints = typing.get_type_hints(method)
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(method).parameters.items():
        if name == "self":
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints[name], default)
    model = create_model(
        f"{method.__name__}_arguments", __config__=ConfigDict(extra="forbid", strict=True), **fields
    )
    try:
        return dict(model.model_validate(arguments))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise ValueError(problems) from None


def answer_tool_calls(env: Any, calls: list[ToolCall]) -> list[Message]:
    """One ``tool`` message per call: the tool's result, or the error the model made. An
    exception raised by a tool is the tool's answer (the model may retry); only the
    environment's own failures (reset/step raising, hanging) fail a trajectory."""
    methods = type(env).tool_methods()
    out: list[Message] = []
    for call in calls:
        if call.error is None and call.name not in methods:
            call = ToolCall(call.name, {}, f"unknown tool {call.name[:80]!r}; tools: {', '.join(methods) or 'none'}")
        if call.error is not None:
            out.append({"role": "tool", "name": call.name[:80], "content": f"error: {call.error}"})
            continue
        try:
            arguments = _check_arguments(methods[call.name], call.arguments)
            result = methods[call.name](env, **arguments)
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except ValueError as exc:
            content = f"error: {exc}"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is its answer to the model
            content = f"error: {type(exc).__name__}: {exc}"
        if len(content) > MAX_RESULT_CHARS:
            content = content[:MAX_RESULT_CHARS] + " ...(truncated)"
        out.append({"role": "tool", "name": call.name, "content": content})
    return out
