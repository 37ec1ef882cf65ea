"""The scored program's side of the ``code`` reward's tests (standard library only).

This file runs inside the sandbox, as the second half of the program's ``main.py``
(after :mod:`.code_wire`, whose ``to_wire``, ``from_wire`` and ``dumps`` it uses). It
runs the program, then answers the test driver's requests (call this function, read
that attribute) on a private copy of stdin/stdout, one JSON line each way.

Nothing here is trusted. The program shares this process and may rewrite any of it; all
it can gain is to answer with other values, which is what a program computing those
values would do. The tests, the expected values and the verdict stay in the driver's
process (:mod:`.code_tests`), which this process cannot reach.
"""

import builtins
import json
import os
import sys
import types

try:  # imported (tests, type checks); in the sandbox these are defined above, in main.py
    from forgerl_plugins.rewards.code_wire import dumps, from_wire, to_wire
except ImportError:
    pass

MAX_REFS = 100_000
#: A global larger than this stays in the program and is sent as a reference.
MAX_GLOBAL_BYTES = 65536
TAKE_MAX = 1024


def serve():
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    # The program's own reads and prints must not touch the conversation.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    refs: list = []

    def make_ref(value):
        if len(refs) >= MAX_REFS:
            raise ValueError("too many objects referenced")
        refs.append(value)
        return len(refs) - 1

    def ref(number, _type_name):
        if 0 <= number < len(refs):
            return refs[number]
        raise ValueError("unknown reference")

    def reply(message):
        replies.write(dumps(message).encode())
        replies.flush()

    namespace = {"__name__": "solution", "__builtins__": builtins}
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - the program's failure is reported, not ours
        reply({"raised": type(exc).__name__})
        return
    reply({"names": describe_globals(namespace, make_ref)})
    for line in requests:
        try:
            message = answer(json.loads(line), namespace, ref, make_ref)
        except BaseException as exc:  # noqa: BLE001 - whatever the program raised, the driver hears of it
            message = {"raised": type(exc).__name__, "message": safe_str(exc)}
        reply(message)


def describe_globals(namespace, make_ref):
    names: dict = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = {"module": value.__name__}
        elif callable(value):
            names[name] = {"callable": True}
        else:
            try:
                wire = to_wire(value, make_ref)
                small = len(json.dumps(wire)) <= MAX_GLOBAL_BYTES
            except Exception:  # noqa: BLE001 - an odd value stays in the program
                small = False
            names[name] = {"value": wire if small else {"ref": make_ref(value), "type": type(value).__name__}}
    return names


def answer(request, namespace, ref, make_ref):
    target = namespace[request["name"]] if "name" in request else ref(request["ref"], "")
    op = request["op"]
    if op == "call":
        args = [from_wire(a, ref) for a in request["args"]]
        kwargs = {k: from_wire(v, ref) for k, v in request["kwargs"].items()}
        value = target(*args, **kwargs)
        # The arguments after the call: a function that sorts a list in place is seen to.
        return {"value": to_wire(value, make_ref), "args": [to_wire(a, make_ref) for a in args]}
    if op == "getattr":
        return {"value": to_wire(getattr(target, request["attr"]), make_ref)}
    if op == "take":
        items = []
        for _ in range(max(1, min(int(request["n"]), TAKE_MAX))):
            try:
                items.append(next(target))
            except StopIteration:
                return {"value": to_wire(items, make_ref), "end": True}
        return {"value": to_wire(items, make_ref), "end": False}
    functions: dict = {"bool": bool, "len": len, "str": str, "iter": iter, "contains": lambda t, x: x in t,
                 "getitem": lambda t, k: t[k]}  # fmt: skip
    if op in functions:
        args = [from_wire(a, ref) for a in request.get("args", [])]
        return {"value": to_wire(functions[op](target, *args), make_ref)}
    raise ValueError(f"unknown request {op!r}")


def safe_str(exc):
    try:
        return str(exc)[:300]
    except BaseException:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    serve()
