"""The Environment interface: multi-turn, tool-using rollouts.

One instance per trajectory. The run calls, each on a worker thread under a deadline
(``environment.turn_timeout``, :mod:`forgerl.rollouts.bounded`):

- :meth:`Environment.reset` once, with the task's problem: the first chat messages;
- :meth:`Environment.step` after every assistant turn, with the turn's text: a
  :class:`Step` holding observation messages to append (the model speaks again), or
  ``done`` with an optional reward and components.

Tools are methods marked :func:`tool`: their JSON schemas come from their signatures and
docstrings (:func:`tool_schemas`) and are offered to the model through the chat template.
The default :meth:`Environment.step` answers the tool calls it finds in the turn
(:mod:`forgerl.tool_calls`) and hands a turn without any to :meth:`Environment.answer`.

An environment that raises, hangs past the deadline or returns something that is not a
list of messages / a :class:`Step` fails its trajectory (scored ``loop.failed_reward``,
counted and recorded with the reason), never the run.
"""

from __future__ import annotations

import abc
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from forgerl.types import Problem

Message = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])

_TOOL_MARK = "__forge_tool__"


@dataclass(frozen=True)
class Step:
    """What an environment answers to one assistant turn.

    ``messages``: observations appended to the conversation (``tool`` or ``user``
    messages); the model then takes another turn. ``done``: the trajectory ends here;
    ``reward`` (None: the run's Reward plugins score the last assistant turn) and
    ``components`` (named parts, for metrics; ``correct`` counts as the held-out accuracy).
    """

    messages: Sequence[Message] = ()
    done: bool = False
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def observe(cls, *messages: Message) -> Step:
        return cls(messages=list(messages))

    @classmethod
    def finish(cls, reward: float | None = None, **components: float) -> Step:
        return cls(done=True, reward=reward, components=components)


def tool(fn: F) -> F:
    """Mark a method of an :class:`Environment` as a tool the model may call. Its typed
    parameters (str, int, float, bool, list) and docstring (first paragraph: what it does;
    ``Args:`` lines ``name: what it is``) make its JSON schema."""
    setattr(fn, _TOOL_MARK, True)
    return fn


class Environment(abc.ABC):
    """One trajectory's world. Subclass it, give it a ``name`` and (optionally) an
    ``Options`` model; the class is built once per trajectory as ``Cls(options)``."""

    #: True when :meth:`step` gives the final reward itself; then a trajectory cut short
    #: by a limit (turns, tokens) scores 0 with component ``limit`` = 1. False: the run's
    #: Reward plugins score the last assistant turn, however the trajectory ended.
    scores: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        """Built as ``Cls(options)`` (the validated ``Options``, or the empty options of a
        class without one); a subclass that needs no setup need not define this."""
        self.options = options

    @abc.abstractmethod
    def reset(self, problem: Problem) -> list[Message]:
        """The conversation's start (e.g. a system and a user message) for ``problem``."""

    def step(self, assistant_text: str) -> Step:
        """Answer one assistant turn. The default calls the tools the turn asks for (each
        answer a ``tool`` message; a malformed or unknown call is answered with an error the
        model can read) and hands a turn that calls none to :meth:`answer`."""
        from forgerl.tool_calls import answer_tool_calls, parse_tool_calls

        calls = parse_tool_calls(assistant_text)
        if not calls:
            return self.answer(assistant_text)
        return Step(messages=answer_tool_calls(self, calls))

    def answer(self, assistant_text: str) -> Step:
        """A turn without tool calls: the default ends the trajectory and leaves scoring to
        the run's Reward plugins."""
        return Step.finish()

    def close(self) -> None:  # noqa: B027 - optional, like Task.load_state_dict
        """Release what the instance holds. Called once the trajectory ends (on a worker
        thread, under the deadline too)."""

    @classmethod
    def tool_methods(cls) -> dict[str, Callable[..., Any]]:
        """The methods marked :func:`tool`, by name, in definition order."""
        found: dict[str, Callable[..., Any]] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if callable(value) and getattr(value, _TOOL_MARK, False):
                    found[name] = value
        return found


# ------------------------------------------------------------------- tool schemas

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin = typing.get_origin(annotation)
    if origin in (list, Sequence, tuple):
        args = typing.get_args(annotation)
        item = _json_type(args[0], where) if args else {}
        return {"type": "array", "items": item}
    raise TypeError(f"{where}: a tool parameter must be str, int, float, bool or list, not {annotation!r}")


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph, and ``name: text`` lines of an ``Args:`` section."""
    doc = inspect.cleandoc(doc or "")
    head = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.split(r"^\s*(?:Args|Arguments|Parameters):\s*$", doc, maxsplit=1, flags=re.M)
    if len(section) == 2:
        for line in section[1].splitlines():
            m = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$", line)
            if m:
                args[m.group(1)] = m.group(2).strip()
    return head, args


def tool_schema(method: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style function schema of one tool method (what chat templates take)."""
    name = method.__name__
    hints = typing.get_type_hints(method)
    description, arg_docs = _doc_parts(method.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(method).parameters.items():
        if pname == "self":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name}: *args/**kwargs cannot be described to a model")
        if pname not in hints:
            raise TypeError(f"tool {name}: parameter {pname!r} has no type annotation")
        prop = _json_type(hints[pname], f"tool {name}, parameter {pname!r}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_schemas(env: Environment | type[Environment]) -> list[dict[str, Any]]:
    """The schemas of every tool of ``env`` (empty: the environment offers none)."""
    cls = env if isinstance(env, type) else type(env)
    return [tool_schema(m) for m in cls.tool_methods().values()]
