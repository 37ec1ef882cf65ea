"""What the Environment kit plays against the environment under test: the assistant turns
(the plugin's own, a well-formed call of every tool, hostile text), trajectories played
the way a run plays them (every call on a worker thread under a deadline, checked with the
run's own checks), a chat tokenizer for the run's trajectory runner, and a scripted
generator that "samples" the kit's turns through it.

Nothing here imports torch; the tokenizer needs ``tokenizers`` and ``transformers`` (the
tokenizer classes only), both dependencies of forgerl.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forgerl.interfaces import Generator
from forgerl.rollouts import bounded
from forgerl.testing.reward import HARD_TEXTS

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.environment import Environment, Step
    from forgerl.types import Completion, FinishReason, GenerationRequest, Problem

#: The kit's chat template (ChatML, as the tiny model and Qwen2/SmolLM2 instruct models
#: have): it ignores ``tools=``, so the run describes the tools in the system prompt.
KIT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: A name no environment gives an option or a tool.
UNKNOWN = "kit_unknown_option"

# Argument values by JSON type: a plain one, and hostile ones (each set takes the k-th).
_PLAIN: dict[str, Any] = {"string": "2 + 2", "integer": 2, "number": 2.5, "boolean": True}
_HOSTILE: dict[str, list[Any]] = {
    "string": [
        "",
        "x" * 7000,
        "../../../../etc/passwd",
        "\x00\x1b[31m\u202e\ud83d\ude42 \ufffd",
        "__import__('os').system('echo pwned')",
    ],
    "integer": [0, -1, 2**63, -(10**30), 10**18],
    "number": [0.0, -1e308, 1e308, 5e-324, -0.0],
    "boolean": [False, True, False, True, False],
}
HOSTILE_SETS = 5


def tool_call(name: str, arguments: Any) -> str:
    """A call in the format the run parses (:mod:`forgerl.tool_calls`)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _value(schema: Mapping[str, Any], k: int | None) -> Any:
    kind = schema.get("type")
    if kind == "array":
        item = _value(schema.get("items") or {"type": "string"}, k)
        return [item] if k is None else [[], [item] * 200, [item], [item, item], []][k % HOSTILE_SETS]
    if kind not in _PLAIN:
        return "2 + 2"
    return _PLAIN[kind] if k is None else _HOSTILE[kind][k % HOSTILE_SETS]


def arguments(schema: Mapping[str, Any], k: int | None = None) -> dict[str, Any]:
    """Arguments of the right types for a tool's schema: plain ones (``k`` None), or the
    ``k``-th set of hostile values (empty, huge, paths, control characters, extremes)."""
    props = schema["function"]["parameters"]["properties"]
    return {name: _value(prop, k) for name, prop in props.items()}


def step_turns(turns: Sequence[str], schemas: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The trajectories a well-behaved model could play, by label: each of the plugin's
    ``turns`` (repeated while the trajectory goes on), and a plain call of each tool
    followed by the first of ``turns``."""
    out = {f"turn {t[:40]!r}": [t] for t in turns}
    for s in schemas:
        name = s["function"]["name"]
        out[f"a plain call of tool {name!r}"] = [tool_call(name, arguments(s)), *turns[:1]]
    return out


def hostile_turns(schemas: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Assistant turns a model being trained can and will write, by label."""
    first = schemas[0]["function"]["name"] if schemas else "calculate"
    out = dict(HARD_TEXTS)
    out.update({
        "tool call that is not JSON": "<tool_call>{name: calculate, arguments: (1 +</tool_call>",
        "unterminated tool call": f'<tool_call>{{"name": "{first}", "arguments": {{',
        "tool call of an unknown tool": tool_call("kit_no_such_tool", {}),
        "tool call of a method that is not a tool": tool_call("reset", {"problem": "x"}),
        "tool call of a dunder": tool_call("__init__", {}),
        "tool call whose arguments are a list": tool_call(first, [1, 2]),
        "tool call whose arguments are a JSON string": tool_call(first, json.dumps({"x": 1})),
        "tool call with an unknown argument": tool_call(first, {UNKNOWN: 1}),
        "tool call with no arguments": tool_call(first, {}),
        "tool call over 8,000 characters": tool_call(first, {"x": "y" * 9000}),
        "deeply nested JSON in a tool call": "<tool_call>" + "[" * 3990 + "]" * 3990 + "</tool_call>",
        "20 tool calls in one turn": "\n".join(tool_call(first, {}) for _ in range(20)),
        "tool call inside 300 kB of text": "blah " * 30_000 + tool_call(first, {}) + " blah" * 30_000,
        "text after a closing tag only": "</tool_call></tool_call>{\"name\": 1}",
    })  # fmt: skip
    for s in schemas:
        name = s["function"]["name"]
        wrong = {p: {"nested": [None, {"x": 1}]} for p in s["function"]["parameters"]["properties"]}
        out[f"tool {name!r} with arguments of the wrong types"] = tool_call(name, wrong)
        for k in range(HOSTILE_SETS):
            out[f"tool {name!r} with hostile arguments (set {k})"] = tool_call(name, arguments(s, k))
    return out


# ------------------------------------------------------------------ playing


@dataclass
class Played:
    """One trajectory as the kit played it: what reset and each step returned, or why the
    run would have failed it (``failure``), and what close raised (``close_error``)."""

    label: str
    problem_id: str
    reset: list[dict[str, Any]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    failure: str | None = None
    close_error: str | None = None

    @property
    def ended(self) -> Step | None:
        return self.steps[-1] if self.steps and self.steps[-1].done else None

    def record(self) -> tuple[Any, ...]:
        """What must repeat on a fresh instance: the messages, and each step's content."""
        return (_messages(self.reset), tuple(step_record(s) for s in self.steps), self.failure)

    def where(self) -> str:
        return f"problem {self.problem_id!r}, {self.label}"


def step_record(step: Step) -> tuple[Any, ...]:
    return (_messages(step.messages), step.done, step.reward, tuple(sorted(dict(step.components).items())))


def _messages(messages: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return tuple(json.dumps(m, sort_keys=True, default=repr) for m in messages)


class Trajectory:
    """One environment instance driven as the run drives it: each call (init, reset,
    step, close) on a worker thread under ``timeout`` (:func:`forgerl.rollouts.bounded.call_bounded`),
    each answer checked with the run's own checks (:mod:`forgerl.rollouts.trajectory`)."""

    def __init__(self, make_env: Callable[[], Environment], problem: Problem, label: str, timeout: float):
        self.make_env, self.timeout = make_env, timeout
        self.env: Environment | None = None
        self.played = Played(label, problem.id)
        self.problem = problem

    async def call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        from forgerl.rollouts.bounded import call_bounded

        return await call_bounded(fn, *args, timeout=self.timeout, what=what)

    async def start(self) -> bool:
        from forgerl.rollouts.trajectory import GarbageError, check_messages

        try:
            self.env = await self.call(self.make_env, what="environment init")
            messages = check_messages(await self.call(self.env.reset, self.problem, what="reset"), "reset")
            if not messages:
                raise GarbageError("reset returned no messages")
            self.played.reset = messages
            return True
        except Exception as exc:  # noqa: BLE001 - reported as the run would record it
            self.played.failure = failure(exc, "reset")
            return False

    async def step(self, text: str) -> Step | None:
        """The environment's answer to ``text``, or None (``failure`` says why)."""
        from forgerl.rollouts.trajectory import check_step

        assert self.env is not None, "step before start"
        try:
            step = check_step(await self.call(self.env.step, text, what="step"))
        except Exception as exc:  # noqa: BLE001 - reported as the run would record it
            self.played.failure = failure(exc, f"step {len(self.played.steps) + 1}")
            return None
        self.played.steps.append(step)
        return step

    async def close(self) -> None:
        if self.env is None:
            return
        try:
            await self.call(self.env.close, what="close")
        except Exception as exc:  # noqa: BLE001 - reported by the close check
            self.played.close_error = failure(exc, "close")


async def play(
    make_env: Callable[[], Environment], problem: Problem, label: str, texts: Sequence[str], *,
    max_turns: int, timeout: float,
) -> Played:
    """A whole trajectory: reset, then ``texts`` as the assistant's turns (the last one
    repeated) until the environment ends it or ``max_turns`` turns were taken; then close,
    as the run closes every instance it built."""
    t = Trajectory(make_env, problem, label, timeout)
    try:
        if await t.start():
            for turn in range(max_turns):
                step = await t.step(texts[min(turn, len(texts) - 1)])
                if step is None or step.done:
                    break
    finally:
        await t.close()
    return t.played


def failure(exc: BaseException, call: str) -> str:
    """Why the run would fail the trajectory, in the words of its failure record (and the
    metric that counts it), with the line of the environment's code that raised."""
    from forgerl.rollouts.bounded import CallTimeout
    from forgerl.rollouts.trajectory import GarbageError

    if isinstance(exc, CallTimeout):
        return f"{exc} (env/failed_timeout)"
    if isinstance(exc, GarbageError):
        return f"{exc} (env/failed_garbage)"
    where = _raising_line(exc)
    what = f"{call} raised {type(exc).__name__}: {str(exc)[:300]}{f' at {where}' if where else ''}"
    # The run only logs a close that raises; anything else fails the trajectory.
    return what if call == "close" else f"{what} (env/failed_error)"


def _raising_line(exc: BaseException) -> str | None:
    """"file:line" of the deepest frame outside the standard library and forgerl's own
    call machinery: the environment's line that raised (json.loads raising is reported
    where the environment called it)."""
    paths = sysconfig.get_paths()
    stdlib = tuple(os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib"))
    installed = tuple(os.path.realpath(paths[k]) + os.sep for k in ("purelib", "platlib"))

    def environments(filename: str) -> bool:  # site-packages may lie inside the stdlib folder
        real = os.path.realpath(filename)
        return real != os.path.realpath(bounded.__file__) and (real.startswith(installed) or not real.startswith(stdlib))

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if environments(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


# ------------------------------------------------------------ the run's runner


@functools.cache
def kit_tokenizer(folder: str | None = None) -> Any:
    """A chat tokenizer: the one in ``folder`` (a Hugging Face model folder), or the kit's
    own, built in milliseconds: byte-level, no merges, ChatML."""
    if folder is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = KIT_CHAT_TEMPLATE
    return fast


class ScriptedGenerator(Generator):
    """A generator whose "model" writes the kit's turns: request ``JOB-tN`` gets turn N
    of ``scripts[JOB]`` (the last one repeated), as token ids ending with the eos token
    (cut at ``max_tokens``, finish reason ``length``), logprob -1 each. It tests the
    environment inside the run's trajectory runner, not sampling."""

    receives_weights = False

    def __init__(self, tokenizer: Any, scripts: Mapping[str, Sequence[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts

    @property
    def policy_version(self) -> int:
        return 0

    def update_weights(self, version: int) -> None:
        raise NotImplementedError("the kit's scripted generator serves no weights")

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        from forgerl.types import Completion

        out = []
        for r in requests:
            job, _, turn = r.request_id.rpartition("-t")
            script = self.scripts[job]
            text = script[min(int(turn), len(script) - 1)]
            ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
            cut = ids[: r.sampling.max_tokens]
            reason: FinishReason = "stop" if len(cut) == len(ids) else "length"
            decoded = str(self.tokenizer.decode(cut, skip_special_tokens=True))
            out.append([Completion(cut, [-1.0] * len(cut), reason, 0, decoded)])
        return out
