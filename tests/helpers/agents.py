"""Agents for the agent-endpoint tests, written against the official ``openai`` client as
any agent would be, and a scripted generator to serve them without a model.

The functions are the ``agent`` environment's ``entry`` targets
(``tests.helpers.agents:NAME``); what each saw goes into :data:`SEEN` under its problem's
id, for the test to compare with what the run recorded."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from forgerl.interfaces import Generator
from forgerl.types import Completion

#: problem id -> what the agent of that episode saw (responses, errors, statuses).
SEEN: dict[str, dict[str, Any]] = {}
#: Released at teardown (tests/faults): hung agents return then.
RELEASE = threading.Event()
#: The first base URL an episode of :func:`steals_urls` saw.
STOLEN: list[str] = []

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 2"}}</tool_call>'
#: The calculator as a strict tool (OpenAI's structured outputs): arguments must validate.
STRICT_CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "strict": True,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                       "additionalProperties": False},
    },
}
#: A call whose arguments break the calculator's schema (``value`` where it requires ``expression``).
BAD_CALL = '<tool_call>{"name": "calculate", "arguments": {"value": "2 + 2"}}</tool_call>'


class Scripted(Generator):
    """Answers call ``k`` of every episode with ``turns[k]`` (+ eos), logprob -0.25 per
    token, at ``version``; records every request and batch size. With ``hold_first``, the
    first batch waits (60 s at most) until ``hold_first()`` is true: a test that checks
    batching lets the other episodes' calls queue behind it without racing them."""

    def __init__(self, tokenizer: Any, turns: Sequence[str], version: int = 3, fail: bool = False,
                 hold_first: Callable[[], bool] | None = None):
        self.tokenizer = tokenizer
        self.hold_first = hold_first
        self.turns = list(turns)
        self.version = version
        self.fail = fail
        self.requests: list[Any] = []
        self.batches: list[int] = []
        self.completions: dict[str, Completion] = {}

    async def generate(self, requests):
        if self.fail:
            raise RuntimeError("engine died")
        if self.hold_first is not None and not self.batches:
            deadline = time.monotonic() + 60
            while not self.hold_first():
                assert time.monotonic() < deadline, "the held batch's condition never came true"
                await asyncio.sleep(0.01)
        self.batches.append(len(requests))
        out = []
        for r in requests:
            self.requests.append(r)
            k = int(r.request_id.rsplit("-c", 1)[1])
            text = self.turns[min(k, len(self.turns) - 1)]
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            ids = [*ids[: r.sampling.max_tokens - 1], self.tokenizer.eos_token_id]
            c = Completion(ids, [-0.25] * len(ids), "stop", self.version, text)
            self.completions[r.request_id] = c
            out.append([c])
        return out

    def update_weights(self, version):
        raise AssertionError("not used")

    @property
    def policy_version(self):
        return self.version


def _client(episode, **kw):
    from openai import OpenAI

    return OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, **kw)


def _first_messages(episode) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": str(episode.problem.prompt)}]


def chat_twice(episode):
    """Two calls, the second extending the first with the message it got (the SDK's
    object, sent back as it is) and a question; the reward is its own."""
    client = _client(episode)
    messages: list[Any] = _first_messages(episode)
    first = client.chat.completions.create(model="gpt-4o", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": "Are you sure?"}]
    second = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=100_000)
    models = [m.id for m in client.models.list()]
    SEEN[episode.problem.id] = {"replies": [first, second], "models": models, "base_url": episode.base_url}
    return {"reward": 0.5, "components": {"correct": 1.0}}


def uses_tools(episode, tool=CALCULATE):
    """Offers a tool; answers the calls the model makes; leaves the reward to the run."""
    client = _client(episode)
    messages: list[Any] = _first_messages(episode)
    replies = []
    for _ in range(3):
        reply = client.chat.completions.create(model="m", messages=messages, tools=[tool])
        replies.append(reply)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})  # noqa: S307 - the test's own expression
    SEEN[episode.problem.id] = {"replies": replies}
    return None


def uses_strict_tools(episode):
    """:func:`uses_tools` with the calculator offered as a strict tool."""
    return uses_tools(episode, STRICT_CALCULATE)


def rewrites_history(episode):
    """A second call that starts over with a summary instead of extending the first."""
    client = _client(episode)
    first = client.chat.completions.create(model="m", messages=_first_messages(episode))
    summary = [{"role": "user", "content": f"Earlier you said: {first.choices[0].message.content}. Go on."}]
    second = client.chat.completions.create(model="m", messages=summary)
    SEEN[episode.problem.id] = {"replies": [first, second]}
    return 1.0


def until_refused(episode):
    """Calls (extending the conversation) until the endpoint refuses, as an agent loop
    with no turn limit of its own does; stops there."""
    import openai

    client = _client(episode)
    messages: list[Any] = _first_messages(episode)
    replies, error = [], None
    for _ in range(50):
        try:
            reply = client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as exc:
            error = exc
            break
        replies.append(reply)
        messages += [reply.choices[0].message, {"role": "user", "content": "More."}]
    SEEN[episode.problem.id] = {"replies": replies, "error": error}
    if error is not None:
        raise error  # an agent that gives up with the error: cut by a limit, not a failure
    return None


def raw(url: str, body: bytes | None = None, *, key: str | None, method: str = "POST",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP request; (status, headers, JSON body or text)."""
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, got, text = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        status, got, text = exc.code, dict(exc.headers), exc.read()
    try:
        return status, got, json.loads(text)
    except ValueError:
        return status, got, text


def raw_status(base_url: str, request: bytes) -> int:
    """Send ``request`` as bytes to the endpoint; the status of the answer."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(base_url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ")[1])


def attacks(episode):
    """Hostile requests to its own live episode, then one good call."""
    url = f"{episode.base_url}/chat/completions"
    good = json.dumps({"model": "m", "messages": _first_messages(episode)}).encode()
    seen: dict[str, Any] = {}
    seen["bad json"] = raw(url, b"{not json", key=episode.api_key)
    seen["not an object"] = raw(url, b"[1, 2]", key=episode.api_key)
    seen["stream"] = raw(url, json.dumps({"messages": _first_messages(episode), "stream": True}).encode(), key=episode.api_key)
    seen["n"] = raw(url, json.dumps({"messages": _first_messages(episode), "n": 3}).encode(), key=episode.api_key)
    seen["no messages"] = raw(url, b'{"messages": []}', key=episode.api_key)
    seen["bad role"] = raw(url, b'{"messages": [{"role": "wizard", "content": "x"}]}', key=episode.api_key)
    seen["image"] = raw(url, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}).encode(), key=episode.api_key)
    seen["bad max_tokens"] = raw(url, json.dumps({"messages": _first_messages(episode), "max_tokens": -5}).encode(),
                                 key=episode.api_key)
    seen["no key"] = raw(url, good, key=None)
    seen["wrong key"] = raw(url, good, key=episode.api_key + "x")
    seen["unknown episode"] = raw(url.replace("/episodes/", "/episodes/zz"), good, key=episode.api_key)
    seen["unknown path"] = raw(episode.base_url.split("/episodes/")[0] + "/v1/chat/completions", good, key=episode.api_key)
    seen["GET completions"] = raw(url, None, key=episode.api_key, method="GET")
    seen["too big"] = raw(url, b" " * (3 << 20), key=episode.api_key)
    seen["huge prompt"] = raw(url, json.dumps({"messages": [{"role": "user", "content": "the " * 50_000}]}).encode(),
                              key=episode.api_key)
    path = url.split("://", 1)[1].split("/", 1)[1]
    auth = f"Authorization: Bearer {episode.api_key}\r\n"
    seen["chunked"] = raw_status(url, (f"POST /{path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n"
                                       "5\r\nhello\r\n0\r\n\r\n").encode())
    seen["header flood"] = raw_status(url, f"POST /{path} HTTP/1.1\r\nX-Junk: {'j' * 70_000}\r\n\r\n".encode())
    seen["two lengths"] = raw_status(url, (f"POST /{path} HTTP/1.1\r\n{auth}Content-Length: 2\r\n"
                                           "Content-Length: 3\r\n\r\n{}").encode())
    seen["not http"] = raw_status(url, b"HELLO\r\n\r\n")
    seen["model"] = raw(f"{episode.base_url}/models/{episode.model}", None, key=episode.api_key, method="GET")
    seen["good"] = raw(url, good, key=episode.api_key)
    SEEN[episode.problem.id] = seen
    return None


# ------------------------------------------------------------------ faulty agents


def hangs(episode):
    _client(episode).chat.completions.create(model="m", messages=_first_messages(episode))
    RELEASE.wait()
    return 1.0


async def hangs_async(episode):
    import asyncio

    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=_first_messages(episode))
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        SEEN[episode.problem.id] = {"cancelled": True}
        raise


def crashes(episode):
    _client(episode).chat.completions.create(model="m", messages=_first_messages(episode))
    raise KeyError("the agent's own bug")


def returns_garbage(episode):
    _client(episode).chat.completions.create(model="m", messages=_first_messages(episode))
    return "yes, solved"


def returns_nan(episode):
    _client(episode).chat.completions.create(model="m", messages=_first_messages(episode))
    return {"reward": float("nan")}


def wrong_key(episode):
    from openai import OpenAI

    OpenAI(base_url=episode.base_url, api_key="sk-not-the-runs-key", max_retries=0).chat.completions.create(
        model="m", messages=_first_messages(episode))
    return 1.0


def steals_urls(episode):
    """The first episode keeps its URL; later ones call it instead of their own."""
    if not STOLEN:
        STOLEN.append(episode.base_url)
        _client(episode).chat.completions.create(model="m", messages=_first_messages(episode))
        return 1.0
    from openai import OpenAI

    OpenAI(base_url=STOLEN[0], api_key=episode.api_key, max_retries=0).chat.completions.create(
        model="m", messages=_first_messages(episode))
    return 1.0


def never_calls(episode):
    return 1.0


def shows_images(episode):
    """Two calls through the ``openai`` client: an image with the question, then the reply
    and a second image (a data URL each); then a file path, which the endpoint must refuse."""
    import openai

    from tests.helpers import images as im

    client = _client(episode)
    red = im.data_url(im.png(40, 24, (255, 0, 0)))
    blue = im.data_url(im.png(17, 30, (0, 0, 255)))
    messages: list[Any] = im.chat(im.image_part(red), text="What colour?")
    first = client.chat.completions.create(model="gpt-4o", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": [im.image_part(blue), {"type": "text", "text": "And now?"}]}]
    second = client.chat.completions.create(model="gpt-4o", messages=messages)
    refused = None
    try:
        client.chat.completions.create(model="gpt-4o", messages=im.chat(im.image_part("/etc/passwd")))
    except openai.BadRequestError as exc:
        refused = exc.message
    SEEN[episode.problem.id] = {"replies": [first, second], "refused": refused}
    return {"reward": 0.5}
