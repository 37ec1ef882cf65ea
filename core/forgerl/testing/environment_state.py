"""What the Environment kit looks at to find state shared between trajectories: the
object graph of each live instance, fingerprints of class-level objects, and the
process-global random generators.

An environment instance is one trajectory's state. The run builds one per trajectory and
runs up to ``environment.concurrency`` of them at once, so anything mutable that two
instances reach is state one trajectory can change under another. :func:`walk` follows an
instance's attributes (``__dict__`` and ``__slots__``), the items of containers (lists,
tuples, dicts, sets, deques) and the attributes of the objects it meets, to any depth; it
reports every mutable object it reaches (a list, dict, set, bytearray, deque, an object
with attributes of its own, a writable buffer such as a numpy array) by the path that
reached it (``self.board.cells[0]``). Class attributes of the objects it meets are
collected apart (``type(self.board).cells``): a class-level table read by every instance
is fine, one a trajectory changes is shared state; the kit fingerprints them
(:func:`fingerprint`) before and after trajectories to tell which.

What it does not follow: what the run shares by design (the options object, the problem
handed to ``reset``) and what the kit is told is shared (``shared`` paths), callables
(functions, methods, classes, closures), modules, and objects of the standard library's
synchronisation and logging modules (a lock, a semaphore or a logger shared between
instances is a design, not a leak). It cannot see state outside Python objects reachable
from the instance: a module's globals read through a function, C-library globals, files.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import random
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Objects reached beyond this many are not followed (a loaded dataset on an instance).
MAX_OBJECTS = 100_000

_ATOMS = (str, bytes, int, float, complex, bool, type(None), range, slice, type(Ellipsis), enum.Enum)
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType, property,
           classmethod, staticmethod)  # fmt: skip
_CONTAINERS = (list, dict, set, bytearray, collections.deque)
#: Standard-library modules whose objects are shared by design (locks, pools, loggers).
_BY_DESIGN = ("threading", "_thread", "logging", "asyncio", "concurrent", "queue", "multiprocessing",
              "weakref", "_weakrefset", "socket", "selectors", "ssl", "subprocess", "io", "_io", "re")  # fmt: skip


@dataclass
class Reach:
    """What one instance reaches: mutable objects by id (with the first path and the object,
    kept alive so that ids stay unique), and class-level objects by id (``Class.attr``)."""

    mutable: dict[int, tuple[str, Any]] = field(default_factory=dict)
    class_level: dict[int, tuple[str, Any]] = field(default_factory=dict)


def walk(root: Any, *, skip: Iterable[Any] = (), skip_paths: Iterable[str] = ()) -> Reach:
    """Every mutable object ``root`` reaches, and the class-level objects on the way. The
    objects in ``skip`` and at the paths in ``skip_paths`` (dotted, from the instance:
    ``"sandbox"``) are not followed."""
    skip_ids = {id(o) for o in skip}
    skipped_paths = {f"self.{p}" for p in skip_paths}
    reach = Reach()
    seen = {id(root)}
    queue: collections.deque[tuple[Any, str]] = collections.deque(_children(root, "self", reach))
    while queue and len(seen) < MAX_OBJECTS:
        obj, path = queue.popleft()
        if id(obj) in seen or id(obj) in skip_ids or path in skipped_paths or not _followed(obj):
            continue
        seen.add(id(obj))
        if _mutable(obj):
            reach.mutable[id(obj)] = (path, obj)
        queue.extend(_children(obj, path, reach))
    return reach


def shared_between(reaches: list[Reach]) -> list[str]:
    """The mutable objects reached from more than one instance, each once, as ``"PATH of
    instance i is PATH of instance j"``; what lies inside an object already reported is not
    reported again."""
    first: dict[int, tuple[int, str]] = {}
    reported: list[tuple[int, str]] = []
    out = []
    for i, reach in enumerate(reaches):
        for key, (path, _) in reach.mutable.items():  # shorter paths first: walk() is breadth-first
            if key not in first:
                first[key] = (i, path)
                continue
            j, other = first[key]
            if j == i or any(k == j and _inside(other, p) for k, p in reported):
                continue
            reported.append((j, other))
            out.append(f"{other} of instance {j + 1} is {path} of instance {i + 1}")
    return out


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith((parent + ".", parent + "[", parent + " "))


def fingerprint(obj: Any, budget: int = 20_000) -> str:
    """A digest of what ``obj`` holds, its containers' items and its objects' attributes
    included, to any depth (up to ``budget`` objects): it changes when any of it changes."""
    h = hashlib.sha256()
    seen: set[int] = set()
    stack = [obj]
    while stack and budget > 0:
        o = stack.pop()
        budget -= 1
        if isinstance(o, _ATOMS):
            h.update(repr(o).encode("utf-8", "replace")[:10_000])
            continue
        if id(o) in seen or not _followed(o):
            h.update(type(o).__qualname__.encode())
            continue
        seen.add(id(o))
        h.update(f"<{type(o).__qualname__}".encode())
        buffer = _writable_buffer(o)
        if buffer is not None:
            h.update(buffer.tobytes()[:1 << 20])
        items = list(_items(o))
        h.update(str(len(items)).encode())
        stack.extend(reversed(items))
        h.update(b">")
    return h.hexdigest()


def global_random_state() -> dict[str, Any]:
    """The state of the process-global random generators: Python's ``random`` module, and
    numpy's legacy global generator when numpy is already imported (never imported here)."""
    state: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy.random"] = (kind, hashlib.sha256(keys.tobytes()).hexdigest(), pos, has_gauss, gauss)
    return state


# ------------------------------------------------------------------------ parts


def _followed(obj: Any) -> bool:
    if isinstance(obj, _ATOMS) or isinstance(obj, _OPAQUE):
        return False
    if callable(obj) and not isinstance(obj, _CONTAINERS):
        return False  # functions, partials, bound methods: their captured state is not followed
    module = (getattr(type(obj), "__module__", "") or "").split(".")[0]
    return module not in _BY_DESIGN


def _mutable(obj: Any) -> bool:
    if isinstance(obj, _CONTAINERS):
        return True
    if isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, (tuple, frozenset)):
        return True
    return _writable_buffer(obj) is not None


def _writable_buffer(obj: Any) -> memoryview | None:
    if isinstance(obj, (bytes, str)):
        return None
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    return None if view.readonly else view


def _items(obj: Any) -> Iterator[Any]:
    """What ``obj`` holds: items of containers, attribute values of objects."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield k
            yield v
    elif isinstance(obj, (list, tuple, collections.deque)):
        yield from list(obj)
    elif isinstance(obj, (set, frozenset)):
        yield from sorted(obj, key=repr)
    else:
        for name, value in _attributes(obj):
            yield name
            yield value


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    out = list(vars(obj).items()) if isinstance(getattr(obj, "__dict__", None), dict) else []
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()) if not isinstance(getattr(klass, "__slots__", ()), str) else ():
            if hasattr(obj, name) and not name.startswith("__"):
                out.append((name, getattr(obj, name)))
    return out


def _children(obj: Any, path: str, reach: Reach) -> Iterator[tuple[Any, str]]:
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield v, f"{path}[{_key(k)}]"
            if not isinstance(k, _ATOMS):
                yield k, f"{path} (a key)"
    elif isinstance(obj, (list, tuple, collections.deque)):
        for i, v in enumerate(list(obj)):
            yield v, f"{path}[{i}]"
    elif isinstance(obj, (set, frozenset)):
        for v in list(obj):
            yield v, f"{path} (an item)"
    else:
        own = vars(obj) if isinstance(getattr(obj, "__dict__", None), dict) else {}
        for name, value in _attributes(obj):
            yield value, f"{path}.{name}"
        _class_level(obj, own, path, reach)


def _class_level(obj: Any, own: dict[str, Any], path: str, reach: Reach) -> None:
    """Data attributes of ``obj``'s classes that it reaches (not shadowed by its own)."""
    for klass in type(obj).__mro__:
        if klass is object or (klass.__module__ or "").split(".")[0] in ("builtins", "abc", "typing", "pydantic"):
            continue
        for name, value in list(vars(klass).items()):
            if name.startswith("__") or name in own or not _followed(value) or not _mutable(value):
                continue
            reach.class_level.setdefault(id(value), (f"{klass.__qualname__}.{name} (type({path}).{name})", value))


def _key(k: Any) -> str:
    text = repr(k)
    return text if len(text) <= 40 else text[:37] + "..."
