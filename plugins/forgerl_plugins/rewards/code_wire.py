"""Values between a scored program and the ``code`` reward's test driver, as plain data.

One line of JSON per message. A value is JSON (None, bool, int, float, str, list) or a
one-key object naming a builtin type (``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``,
``set``, ``frozenset``, ``bytes`` as hex, ``complex``) or a reference to an object that
stays in the program's process (``{"ref": n, "type": "Name"}``).

Both sides use this module: the driver imports it, and the program's process runs it as
the first part of its ``main.py`` (so it imports nothing but the standard library). What
makes the verdict safe is :func:`from_wire` on the driver's side: whatever the program
sends, it builds only exact builtin values and :class:`Remote` references the driver
made itself, so no object of the program's (a list subclass whose ``__eq__`` says yes,
an object equal to everything) ever reaches a comparison in a test.
"""

import json

#: Nesting the driver accepts in one value (deeper is a protocol error, not a crash).
MAX_DEPTH = 100

_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "complex", "ref")


def to_wire(value, make_ref, depth=0):
    """``value`` as JSON-ready plain data; anything else becomes ``make_ref(value)``.

    Subclasses of the builtin types travel as their base type's contents (a
    ``defaultdict`` as a dict, a namedtuple as a tuple, an ``IntEnum`` as an int), read
    with the base type's own methods."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    depth += 1
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, complex):
        return {"complex": [complex.real.__get__(value), complex.imag.__get__(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [to_wire(v, make_ref, depth) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [to_wire(v, make_ref, depth) for v in tuple.__iter__(value)]}
    if isinstance(value, frozenset):
        return {"frozenset": [to_wire(v, make_ref, depth) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"set": [to_wire(v, make_ref, depth) for v in set.__iter__(value)]}
    if isinstance(value, dict):
        items = dict.items(value)
        return {"dict": [[to_wire(k, make_ref, depth), to_wire(v, make_ref, depth)] for k, v in items]}
    return {"ref": make_ref(value), "type": type(value).__name__}


def from_wire(data, resolve_ref, depth=0):
    """Rebuild a value from :func:`to_wire`'s form: exact builtin types only, and
    ``resolve_ref(n, type_name)`` for references. Raises ValueError on anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    depth += 1
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [from_wire(v, resolve_ref, depth) for v in data]
    if kind is not dict or len(data) not in (1, 2):
        raise ValueError(f"not a value: {type(data).__name__}")
    tag = next(iter(data))
    body = data[tag]
    if tag not in _TAGS or (len(data) == 2) != (tag == "ref"):
        raise ValueError(f"not a value tag: {tag!r}")
    if tag == "ref":
        name = data.get("type")
        if type(body) is not int or type(name) is not str:
            raise ValueError("a reference needs an int id and a type name")
        return resolve_ref(body, name[:100])
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("bytes must be hex text")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} must hold a list")
    if tag == "complex":
        if len(body) != 2 or any(type(x) not in (int, float) for x in body):
            raise ValueError("complex must hold two numbers")
        return complex(body[0], body[1])
    items = [from_wire(v, resolve_ref, depth) for v in body]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    pairs = []
    for pair in items:  # tag == "dict": [[k, v], ...]
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("dict items must be [key, value] pairs")
        pairs.append(pair)
    return dict(pairs)


def dumps(message):
    return json.dumps(message, separators=(",", ":")) + "\n"
