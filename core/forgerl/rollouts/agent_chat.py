"""The OpenAI chat-completions wire format, as the agent endpoint reads and writes it.

A request body is hostile input (an agent forwards model-written text, and may be broken
itself): :func:`parse_request` checks every field it uses and raises :class:`ApiError`
(an OpenAI-style error: status, message, the parameter at fault, a code) for anything it
cannot serve. What it serves: ``messages`` (roles system/developer/user/assistant/tool,
text content as a string or text parts, assistant ``tool_calls``), ``tools`` (functions; a
``strict`` one's calls are returned only with arguments that validate against its schema),
``max_tokens``/``max_completion_tokens``, ``stop``. It refuses ``stream: true`` and
``n > 1``. Sampling fields (``temperature``, ``top_p``, ``seed``, penalties, ``logit_bias``,
``response_format``, ``tool_choice``...) are accepted and not applied: the run samples
with its own settings, the ones its trainer's logprobs are computed at.

Messages are compared in a normal form (:func:`message_key`), so that an agent that sends
back the assistant message it received (with ``refusal: null``, ``annotations: null``, its
arguments re-serialised...) is recognised as extending the conversation.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from forgerl.tool_calls import split_tool_calls

#: Messages per request, tools per request, stop strings and their length.
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_STOP = 4
MAX_STOP_CHARS = 256
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ApiError(Exception):
    """An answer in OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}.get(
            self.status, "invalid_request_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatCall:
    """One validated request: messages in normal form (role, string content, and where
    given ``tool_calls``, ``tool_call_id``, ``name``), the tools offered, the sampling
    bounds the agent asked for."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    #: The parameters schema of each tool offered with ``strict: true``, by name: a call of
    #: one whose arguments do not validate is not returned as a tool call.
    strict: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_request(body: bytes) -> ChatCall:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    if data.get("stream") not in (None, False):
        raise ApiError(400, "stream=true is not supported by forgerl's endpoint: call without streaming",
                       param="stream", code="unsupported_parameter")
    n = data.get("n")
    if n not in (None, 1):
        raise ApiError(400, "n must be 1: each call samples one completion (call again for more)",
                       param="n", code="unsupported_parameter")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"at most {MAX_MESSAGES} messages per request", param="messages")
    normal = [normal_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools, strict = _tools(data.get("tools"))
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{key} must be a positive integer", param=key)
        max_tokens = value if max_tokens is None else min(max_tokens, value)
    return ChatCall(normal, tools, max_tokens, _stop(data.get("stop")), strict)


def _text(content: Any, where: str, *, images: bool = False) -> str | list[dict[str, Any]]:
    """Content in normal form: a string, or (``images``, a user or tool message with image
    parts) a list of text and ``image_url`` parts; the images are loaded when rendered."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if images and kind == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str) or not url:
                    raise ApiError(400, f"{where}.content[{j}]: an image_url part needs a url",
                                   param=f"{where}.content")  # fmt: skip
                parts.append({"type": "image_url", "image_url": {"url": url}})
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                allowed = "text and image_url parts" if images else "text parts"
                raise ApiError(400, f"{where}.content[{j}]: only {allowed} are supported", param=f"{where}.content")
            parts.append({"type": "text", "text": part["text"]})
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def normal_message(m: Any, where: str = "message") -> dict[str, Any]:
    """``m`` in normal form, or ApiError naming ``where`` and what is wrong."""
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    given = m.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise ApiError(400, f"{where}.role must be one of {sorted(_ROLES)}", param=f"{where}.role")
    # Images in what the agent shows the model (a user or tool message), never in what the
    # model or the system said (docs/vision.md).
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where, images=role in ("user", "tool"))}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str) or len(value) > 256:
                raise ApiError(400, f"{where}.{key} must be a string of at most 256 characters", param=f"{where}.{key}")
            out[key] = value
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where)
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    call_id = c.get("id")
    return {"id": call_id if isinstance(call_id, str) else "", "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def _tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The tools as the chat template gets them, and the strict ones' parameter schemas."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    out = []
    strict: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise ApiError(400, f"tools[{i}] must be a function with a name of letters, digits, _ . : -",
                           param=f"tools[{i}]")
        schema = {"name": fn["name"]}
        if isinstance(fn.get("description"), str):
            schema["description"] = fn["description"]
        schema["parameters"] = fn["parameters"] if isinstance(fn.get("parameters"), dict) else {
            "type": "object", "properties": {}}
        out.append({"type": "function", "function": schema})
        if fn.get("strict") is True:
            _check_schema(schema["parameters"], f"tools[{i}].function.parameters")
            strict[fn["name"]] = schema["parameters"]
    return out, strict


def _check_schema(schema: dict[str, Any], param: str) -> None:
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise ApiError(400, f"{param} is not a valid JSON schema (strict: true validates against it): "
                       f"{exc.message[:200]}", param=param) from None


def follows_schema(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Whether a call's arguments validate against a strict tool's parameters schema."""
    from jsonschema import validators

    try:
        return bool(validators.validator_for(schema)(schema).is_valid(arguments))
    except Exception:  # noqa: BLE001 - a reference the schema cannot resolve: nothing validates
        return False


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP} non-empty strings "
                       f"of at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(stops)


# ------------------------------------------------------------------ normal forms


def _arguments_key(arguments: str) -> str:
    """Arguments as canonical JSON where they parse (an agent may re-serialise them)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (ValueError, RecursionError):
        return arguments


def message_key(m: dict[str, Any]) -> str:
    """What makes two messages of a conversation the same message."""
    calls = [(c["id"], c["function"]["name"], _arguments_key(c["function"]["arguments"]))
             for c in m.get("tool_calls", ())]
    return json.dumps([m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name")])


def tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True)


def for_template(messages: list[dict[str, Any]], *, tools_in_template: bool) -> list[dict[str, Any]]:
    """``messages`` as a chat template takes them. Assistant tool calls: with arguments as
    objects, for a template that renders tools (transformers' convention); written into the
    content in the ``<tool_call>`` format, for one that does not (the format the system
    prompt teaches the model then, :data:`forgerl.rollouts.chat_tokens.TOOLS_PREAMBLE`)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            bodies = [{"name": c["function"]["name"], "arguments": _loads_or_raw(c["function"]["arguments"])}
                      for c in calls]
            if tools_in_template:
                m["tool_calls"] = [{"type": "function", "id": c["id"], "function": b} for c, b in zip(calls, bodies)]
            else:
                text = "\n".join(f"<tool_call>{json.dumps(b)}</tool_call>" for b in bodies)
                m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        out.append(m)
    return out


def _loads_or_raw(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


# ------------------------------------------------------------------ responses


def assistant_message(
    text: str, *, tools_offered: bool, call_prefix: str, strict: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The assistant message of a sampled turn: its text, and where tools were offered the
    well-formed ``<tool_call>`` blocks as ``tool_calls`` (taken out of the content). As
    OpenAI's ``strict: true`` promises, a call of a ``strict`` tool is returned only if its
    arguments validate against the tool's schema; one that does not stays in the content,
    as a malformed call does (the endpoint cannot constrain sampling: the tokens trained on
    must be the model's own samples)."""
    if not tools_offered:
        return {"role": "assistant", "content": text}
    strict = strict or {}
    rest, calls = split_tool_calls(
        text, accept=lambda c: c.name not in strict or follows_schema(c.arguments, strict[c.name])
    )
    if not calls:
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": rest.strip() or None}
    message["tool_calls"] = [
        {"id": f"{call_prefix}_{i}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for i, c in enumerate(calls)
    ]
    return message


def completion_body(
    *, response_id: str, model: str, message: dict[str, Any], finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    if message.get("tool_calls") and finish_reason == "stop":
        finish_reason = "tool_calls"
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }

