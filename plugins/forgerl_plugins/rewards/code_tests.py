"""The ``code`` reward's test driver: the tests run here, the program in its sandbox.

The program runs in the sandbox (:mod:`.code_server` answers for it); the problem's
``setup`` and tests run in this process, where the program's names are stand-ins
(:class:`Remote`) that ask the program to call a function or read an attribute. Every
answer crosses as plain data (:mod:`.code_wire`), so what a test compares is a real
``int``, ``list`` or ``dict`` built here; the program never sees the tests or the
expected values, and nothing it does in its own process (patching builtins, ``os.write``,
``sys.modules``, walking frames, lying ``__eq__``, ``atexit``) reaches the verdict.

Limits, by design: a test may pass plain values to the program, not functions; an object
of the program's stays there and is compared by identity only; the program's globals are
read once, after it ran.
"""

from __future__ import annotations

import builtins
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgerl_plugins.rewards.code_wire import dumps, from_wire, to_wire
from forgerl_plugins.rewards.conversation import Conversation, ConversationOver
from forgerl_plugins.rewards.sandbox import Sandbox

_HERE = Path(__file__).parent
#: The program's main.py: the value format, then the server that runs the program.
PROGRAM_MAIN = (_HERE / "code_wire.py").read_text() + "\n" + (_HERE / "code_server.py").read_text()

#: Standard-library modules a program's ``import`` may lend its name to the tests (the
#: tests get this process's own module, never the program's); these few do things on import.
_NOT_LENT = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__", "__phello__"}
)
_ITERATION_BATCH = 256


@dataclass
class TestRun:
    passed: list[bool]
    timed_out: bool = False
    #: The program raised before the tests, died or broke the conversation during them.
    errored: bool = False
    reason: str = ""


class ProgramGone(BaseException):
    """The conversation with the program is over. A BaseException so that a test's own
    ``except Exception`` cannot swallow it and pass."""


class RemoteError(Exception):
    """The program raised an exception that is not one of Python's builtin ones."""


def run_tests(sandbox: Sandbox, *, program: str, setup: str, tests: Sequence[str]) -> TestRun:
    """Run ``tests`` (statements) against ``program`` in ``sandbox``; ``setup`` runs in
    both places (the imports the program and the tests need)."""
    run = TestRun(passed=[False] * len(tests))
    files = {"main.py": PROGRAM_MAIN, "solution.py": setup + "\n" + program}
    with sandbox.converse(files) as talk:
        link = _Link(talk)
        try:
            hello = link.hello()
        except ProgramGone as gone:
            run.errored, run.reason = True, str(gone)
        else:
            namespace = _test_namespace(setup, hello, link)
            for i, test in enumerate(tests):
                run.passed[i] = _passes(test, i, namespace) and link.broken is None
                if link.broken is not None:
                    run.errored, run.reason = True, link.broken
                    break
    outcome = talk.outcome
    if outcome is not None and outcome.setup_error:
        # The sandbox failed, not the program: the sample is scored failed, with why.
        raise RuntimeError(f"the sandbox could not run the program: {outcome.setup_error}")
    if outcome is not None and outcome.timed_out:
        run.timed_out, run.errored = True, False
    return run


def _passes(test: str, index: int, namespace: dict[str, Any]) -> bool:
    try:
        exec(compile(test, f"test_{index}", "exec"), namespace)  # noqa: S102 - the problem's own tests
    except ProgramGone:
        return False
    except Exception:  # noqa: BLE001 - a failed assert, or what the program's answer made the test raise
        return False
    return True


def _test_namespace(setup: str, hello: dict[str, Any], link: _Link) -> dict[str, Any]:
    """The tests' globals: builtins and ``setup``'s names are this process's own and
    cannot be shadowed by the program; the program's names are stand-ins for its objects."""
    namespace: dict[str, Any] = {"__name__": "tests", "__builtins__": builtins}
    try:
        exec(compile(setup, "setup", "exec"), namespace)  # noqa: S102 - the problem's own setup
    except Exception as exc:  # noqa: BLE001 - any failure of the problem's own code is the problem's
        raise ValueError(f"the problem's setup code fails on its own: {type(exc).__name__}: {exc}") from None
    own = set(namespace) | set(dir(builtins))
    names = hello.get("names")
    if type(names) is not dict:
        link.fail("the program's first answer holds no names")
        return namespace
    for name, info in list(names.items())[:10_000]:
        if not name.isidentifier() or name in own or type(info) is not dict:
            continue
        if "callable" in info:
            namespace[name] = Remote(link, {"name": name}, name)
        elif "module" in info:
            module = _lend_module(info["module"])
            if module is not None:
                namespace[name] = module
        elif "value" in info:
            try:
                namespace[name] = link.decode(info["value"])
            except ProgramGone:
                return namespace
    return namespace


def _lend_module(name: object) -> Any:
    if type(name) is not str or name not in sys.stdlib_module_names or name in _NOT_LENT:
        return None
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _Link:
    """Requests to the program and its answers; the first failure breaks it for good."""

    def __init__(self, talk: Conversation):
        self._talk = talk
        self.broken: str | None = None

    def fail(self, why: str) -> ProgramGone:
        if self.broken is None:
            self.broken = why
        return ProgramGone(self.broken)

    def hello(self) -> dict[str, Any]:
        reply = self._reply()
        if "raised" in reply:
            raise self.fail(f"the program raised {str(reply['raised'])[:100]} before the tests")
        return reply

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.broken is not None:
            raise ProgramGone(self.broken)
        try:
            self._talk.send(dumps(request).encode())
        except ConversationOver as exc:
            raise self.fail(str(exc)) from None
        reply = self._reply()
        if "raised" in reply:
            raise _exception(reply.get("raised"), reply.get("message"))
        return reply

    def decode(self, wire: Any) -> Any:
        try:
            return from_wire(wire, self._remote)
        except (ValueError, TypeError, RecursionError) as exc:
            raise self.fail(f"the program answered with something that is not a value ({exc})") from None

    def encode(self, value: Any) -> Any:
        """A test's value for the program: plain data, or one of the program's own objects."""

        def only_remotes(obj: Any) -> int:
            if isinstance(obj, Remote) and obj._link is self and "ref" in obj._target:
                return int(obj._target["ref"])
            raise TypeError(
                f"a test can pass the program plain values and objects it returned, not {type(obj).__name__}"
            )

        return to_wire(value, only_remotes)

    def _remote(self, number: int, type_name: str) -> Remote:
        return Remote(self, {"ref": number}, type_name)

    def _reply(self) -> dict[str, Any]:
        try:
            reply = json.loads(self._talk.receive())
        except ConversationOver as exc:
            raise self.fail(str(exc)) from None
        except (ValueError, RecursionError):
            raise self.fail("the program answered with something that is not JSON") from None
        if type(reply) is not dict:
            raise self.fail("the program answered with something that is not a message")
        return reply


def _exception(name: object, message: object) -> Exception:
    """What the program raised, as this process's builtin exception of that name (an
    ``except ValueError`` in a test works), else :class:`RemoteError`. Never a
    BaseException: the program cannot stop the driver by raising ``SystemExit``."""
    text = str(message)[:300] if type(message) is str else ""
    cls = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except TypeError:  # e.g. UnicodeDecodeError wants five arguments
            pass
    return RemoteError(f"{str(name)[:100]}: {text}")


class Remote:
    """An object that stays in the program's process: calling it, reading its attributes,
    iterating it, ``len``, ``in``, indexing and ``str`` are requests to the program, and
    what comes back is plain data or another :class:`Remote`. Equality, ordering and hashing
    are this object's identity: the program is never asked whether it equals something."""

    __slots__ = ("_link", "_target", "_type")

    def __init__(self, link: _Link, target: dict[str, Any], type_name: str):
        self._link, self._target, self._type = link, target, type_name

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        return self._link.ask({"op": op, **self._target, **fields})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        encode = self._link.encode
        reply = self._request(
            "call", args=[encode(a) for a in args], kwargs={k: encode(v) for k, v in kwargs.items()}
        )
        value = self._link.decode(reply.get("value"))
        after = reply.get("args")
        if type(after) is list and len(after) == len(args):
            for mine, theirs in zip(args, after, strict=True):
                _update_in_place(mine, self._link.decode(theirs))
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._value("getattr", attr=name)

    def _value(self, op: str, **fields: Any) -> Any:
        return self._link.decode(self._request(op, **fields).get("value"))

    def __bool__(self) -> bool:
        return _exactly(bool, self._value("bool"))

    def __len__(self) -> int:
        return _exactly(int, self._value("len"))

    def __str__(self) -> str:
        return _exactly(str, self._value("str"))

    def __repr__(self) -> str:
        return f"<{self._type} object of the program>"

    def __contains__(self, item: Any) -> bool:
        return _exactly(bool, self._value("contains", args=[self._link.encode(item)]))

    def __getitem__(self, key: Any) -> Any:
        return self._value("getitem", args=[self._link.encode(key)])

    def __iter__(self) -> Iterator[Any]:
        iterator = self._value("iter")
        if not isinstance(iterator, Remote):
            raise TypeError("the program's iterator is not an object of its own")
        return _RemoteIterator(iterator)

    def __next__(self) -> Any:
        items = self._link.decode(self._request("take", n=1).get("value"))
        if type(items) is not list or not items:
            raise StopIteration
        return items[0]


class _RemoteIterator:
    """Items of an iterator of the program's, fetched a batch at a time."""

    def __init__(self, remote: Remote):
        self._remote, self._end = remote, False
        self._items: list[Any] = []

    def __iter__(self) -> _RemoteIterator:
        return self

    def __next__(self) -> Any:
        if not self._items and not self._end:
            reply = self._remote._request("take", n=_ITERATION_BATCH)
            items = self._remote._link.decode(reply.get("value"))
            if type(items) is not list:
                raise self._remote._link.fail(
                    "the program's iterator answered with something that is not a list"
                )
            self._items, self._end = items, reply.get("end") is not False or not items
            self._items.reverse()
        if not self._items:
            raise StopIteration
        return self._items.pop()


def _exactly(kind: Callable[..., Any], value: Any) -> Any:
    if type(value) is not kind:
        raise TypeError(f"the program answered {type(value).__name__} where {kind.__name__} was due")
    return value


def _update_in_place(mine: Any, theirs: Any) -> None:
    """A list, dict or set a test passed, changed as the program's function changed its copy."""
    if type(mine) is list and type(theirs) is list:
        mine[:] = theirs
    elif type(mine) in (dict, set) and type(theirs) is type(mine):
        mine.clear()
        mine.update(theirs)
