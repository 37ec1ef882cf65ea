"""The identities of backend classes, kept between commands, so that ``forge plugins list``
shows every backend without importing its class's module.

Listing needs a backend's identity only (name, description, what it requires), but
reading it from the class means importing the class's module, and with it pydantic and
every backend's options: about two thirds of the listing's time. The index keeps, for each
class a hook names as ``"module:Class"``, the identity the registry read from it, with
what that identity depends on: the interpreter and ``sys.path``, and the size, times and
inode of every module file the process had imported when the index was written (forgerl,
the backend modules and everything they import), of the folders holding them and of the
folders on ``sys.path`` (so a package installed, removed or upgraded, or a module put
beside one, is noticed). When any of it differs the whole index is dropped: the classes
are imported and the index written anew. A class a hook returns as an object is read as
it is (it is imported already).

Only classes that imported and passed the registry's checks are kept: a name that fails
to import, or names something that is no backend of its kind, is imported again by every
listing, so a broken plugin is reported exactly as without the index. Reading the
identities from the module sources with ``ast`` instead would need no index, but could
not say whether a module imports at all, nor read what a class inherits, computes
(``f"SGLang {SGLANG_VERSION}"``) or takes from its docstring.

The file is ``$XDG_CACHE_HOME/forgerl/backend-index-<environment>.json`` (default
``~/.cache/forgerl``), one per Python environment. It is untrusted input: anything that is
not a regular file of the expected shape, small and without control characters, is
ignored (as is a folder that cannot be written), and its names of code are never used: a
record made from the index imports the class the hook named, as the hook named it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import zlib
from pathlib import Path
from typing import Any

from forgerl.backends import NO_OPTIONS, Backend
from forgerl.configuration.kinds import KINDS
from forgerl.registry.backend_classes import record_for_class

FORMAT = "forgerl-backend-index"
VERSION = 1
#: A larger file is not read (the index of a few hundred backends is far smaller).
MAX_BYTES = 4 << 20
#: The longest string kept (a description, an install hint).
MAX_TEXT = 2000
#: Class attributes a record names by reference: ``"module:Class.<attribute>"``.
PARTS = ("Options", "preflight", "local_preflight", "roles")
_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*\Z")
_OPTIONAL_TEXT = ("extra", "install_hint")


def index_path() -> Path:
    """Where this Python environment's index is kept (OSError/RuntimeError: nowhere)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"  # XDG: a relative one is ignored
    environment = zlib.crc32(f"{sys.executable}\0{sys.prefix}".encode())
    return root / "forgerl" / f"backend-index-{environment:08x}.json"


class BackendIndex:
    """The index as loaded: :meth:`record` makes records from it, and from the classes it
    lacks (which it then keeps); :meth:`save` writes it when it learned something."""

    def __init__(self, path: Path | None, entries: dict[tuple[str, str], dict[str, Any]]):
        self.path = path
        self._entries = entries
        self._learned = False

    @classmethod
    def load(cls) -> BackendIndex:
        """The index of this environment; empty when there is none, it is unreadable or
        malformed, or anything it depends on has changed."""
        try:
            path = index_path()
        except (OSError, RuntimeError):  # no home folder
            return cls(None, {})
        try:
            data = json.loads(_read_regular(path, MAX_BYTES))
            files, entries = _parse(data)
        except (OSError, ValueError, RecursionError):  # absent, unreadable, corrupt, hostile
            return cls(path, {})
        if any(_stat(name) != recorded for name, recorded in files.items()):
            return cls(path, {})
        return cls(path, entries)

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, expected: type[Backend], given: Any, hook: str) -> Backend:
        """The record of backend class ``given`` (as :func:`record_for_class` makes it):
        from the index when it holds ``given``, else from the class, whose identity is
        then kept (when the class passed the checks)."""
        if not isinstance(given, str):
            return record_for_class(expected, given, hook)
        entry = self._entries.get((expected.kind, given))
        if entry is not None:
            return _record_from(expected, given, entry)
        record = record_for_class(expected, given, hook)
        identity = _identity(record, given)
        if identity is not None:
            self._entries[(expected.kind, given)] = identity
            self._learned = True
        return record

    def save(self) -> None:
        """Write the index (atomically) if it learned a class; a folder that cannot be
        written leaves things as they are: the next listing imports the classes again."""
        if not self._learned or self.path is None:
            return
        data = {
            "format": FORMAT,
            "version": VERSION,
            "environment": _environment(),
            "files": [[name, recorded] for name, recorded in _fingerprint().items()],
            "backends": list(self._entries.values()),
        }
        # Written beside it and renamed over it: a listing running meanwhile reads the old
        # index or the new one, never half of one.
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(temporary, self.path)
        except OSError:
            try:
                temporary.unlink()
            except OSError:
                pass


# -------------------------------------------------------------------------- identities


def _identity(record: Backend, ref: str) -> dict[str, Any] | None:
    """What the index keeps of ``record``, made from the class ``ref`` names; None when a
    part cannot be kept as it is (a part named by a string of its own, info that is not
    plain data, text with control characters)."""
    parts = []
    if record.options != NO_OPTIONS:
        parts.append("Options")
    for part in PARTS[1:]:
        value = getattr(record, part, None)
        if value is not None:
            parts.append(part)
    if any(isinstance(getattr(record, "options" if p == "Options" else p), str) for p in parts):
        return None  # "module:attr" given by the class itself: not rebuilt from the class's name
    entry = {
        "kind": record.kind,
        "ref": ref,
        "name": record.name,
        "description": record.description,
        "requires": list(record.requires),
        "extra": record.extra,
        "extra_of": record.extra_of,
        "install_hint": record.install_hint,
        "implemented": record.implemented,
        "info": record.info,
        "parts": parts,
    }
    try:
        # What is kept must read back as it is, or the listing would show something else.
        same = _entry(json.loads(json.dumps(entry))) == entry
    except (ValueError, TypeError, RecursionError):
        return None
    return entry if same else None


def _record_from(expected: type[Backend], ref: str, entry: dict[str, Any]) -> Backend:
    """A record like the one made from the class, that names the class instead of holding
    it: the class's module is imported when the backend is first built or its options read."""
    parts = set(entry["parts"])

    def part(name: str) -> str | None:
        return f"{ref}.{name}" if name in parts else None

    fields: dict[str, Any] = {
        "description": entry["description"],
        "requires": tuple(entry["requires"]),
        "extra": entry["extra"],
        "extra_of": entry["extra_of"],
        "install_hint": entry["install_hint"],
        "implemented": entry["implemented"],
        "info": dict(entry["info"]),
        "preflight": part("preflight"),
        "local_preflight": part("local_preflight"),
    }
    if "roles" in expected.__dataclass_fields__:
        fields["roles"] = part("roles")
    return expected(name=entry["name"], factory=ref, options=part("Options") or NO_OPTIONS, **fields)


# ---------------------------------------------------------------- reading, untrusted


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; never
    blocks (a FIFO put in its place is refused, not waited on) nor follows a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError("not a regular file of the expected size")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise ValueError("too large")
    return data


def _parse(data: Any) -> tuple[dict[str, list[int] | None], dict[tuple[str, str], dict[str, Any]]]:
    """The files an index depends on and its entries; ValueError for anything else than
    an index of this environment, written by this version."""
    if not isinstance(data, dict) or set(data) != {"format", "version", "environment", "files", "backends"}:
        raise ValueError("not an index")
    if data["format"] != FORMAT or data["version"] != VERSION or data["environment"] != _environment():
        raise ValueError("another format, version or environment")
    files: dict[str, list[int] | None] = {}
    for item in _list(data["files"]):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("a bad file entry")
        name, recorded = item
        if recorded is not None and not (
            isinstance(recorded, list) and len(recorded) == 4 and all(type(n) is int for n in recorded)
        ):
            raise ValueError("a bad file entry")
        files[name] = recorded
    entries = {}
    for item in _list(data["backends"]):
        entry = _entry(item)
        entries[(entry["kind"], entry["ref"])] = entry
    return files, entries


def _entry(item: Any) -> dict[str, Any]:
    """``item`` if it is a well-formed identity, else ValueError."""
    keys = {"kind", "ref", "name", "description", "requires", "extra", "extra_of", "install_hint",
            "implemented", "info", "parts"}
    if not isinstance(item, dict) or set(item) != keys:
        raise ValueError("a bad backend entry")
    ok = (
        item["kind"] in KINDS
        and _text(item["ref"]) and _REF.match(item["ref"]) is not None
        and _text(item["name"]) and item["name"] != ""
        and _text(item["description"])
        and _text(item["extra_of"])
        and all(item[k] is None or _text(item[k]) for k in _OPTIONAL_TEXT)
        and isinstance(item["requires"], list) and all(_text(m) and m != "" for m in item["requires"])
        and type(item["implemented"]) is bool
        and isinstance(item["info"], dict) and all(_text(k) and _plain(v) for k, v in item["info"].items())
        and isinstance(item["parts"], list) and set(item["parts"]) <= set(PARTS)
        and len(set(item["parts"])) == len(item["parts"])
    )
    if not ok:
        raise ValueError("a bad backend entry")
    return item


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


def _text(value: Any) -> bool:
    # Printable: what the listing shows must not carry escape sequences to the terminal.
    return isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable()


def _plain(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    return value is None or type(value) in (bool, int) or _text(value)


# ----------------------------------------------------------------- what it depends on


def _environment() -> dict[str, Any]:
    """What decides which module an import finds, besides the files themselves."""
    # A relative entry ("" under `python -c`) is the working folder: resolved, so that
    # another working folder is another environment.
    path = [os.path.abspath(p or os.curdir) for p in sys.path if isinstance(p, str)]
    return {"python": sys.version, "executable": sys.executable, "prefix": sys.prefix, "path": path}


def _stat(name: str) -> list[int] | None:
    """What changes when a file or folder is written, replaced or removed."""
    try:
        info = os.stat(name)
    except (OSError, ValueError):
        return None
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]


def _fingerprint() -> dict[str, list[int] | None]:
    """The files of every module imported now, their folders and the folders on sys.path
    (an entry of another kind, such as a zip file, is a file too)."""
    names = set(_environment()["path"])
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            file = os.path.abspath(file)
            names.add(file)
            names.add(os.path.dirname(file))
    return {name: _stat(name) for name in sorted(names)}
