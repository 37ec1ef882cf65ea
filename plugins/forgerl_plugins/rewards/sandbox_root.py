"""What a sandboxed program sees of the file system at the ``namespace`` and ``bwrap`` levels.

A program written by the model being trained must not read the answers: a run's dataset,
tests and reference solutions are usually world-readable files (in the run directory, a
dataset folder, the project, a home directory, an installed package that ships a
benchmark), and reading them is the cheapest way to a full reward. So the program's root
is not the host's: it is an empty, read-only file system holding only what the
interpreter needs, each at its host path (:class:`RootView`):

* the system's library and program directories (``/usr/lib*``, ``/lib*``, ``/usr/bin``,
  ``/bin``: bound where they are directories, re-made where they are symlinks), which the
  interpreter and its extension modules load from;
* the interpreter: its executable, its standard library (the ``-I -S`` ``sys.path``: the
  standard library's folder, ``lib-dynload``, the zip) and every shared library it and the
  standard library's extension modules load from elsewhere (``libpython`` under a pyenv
  prefix, say), found by loading them all once in the interpreter (:func:`root_view`);
* the time zone database (``/usr/share/zoneinfo``, ``/etc/localtime``) and the dynamic
  loader's cache (``/etc/ld.so.cache``);
* ``/dev/null``, ``zero``, ``full``, ``random`` and ``urandom``.

Every ``site-packages`` and ``dist-packages`` folder inside those is covered by an empty
one: a program gets the standard library only (``-S`` leaves the packages off its path,
and without this it could put them back), and no package's data. The sandbox adds a
``/proc`` of the program's own PID namespace and ``/tmp`` holding only the program's
directory, its one writable place. Nothing else of the host is there: no home directory
(only the interpreter's own files, where it lives in one), run directory, dataset, project
checkout, ``/etc``, ``/var``, ``/opt``, ``/srv`` or ``/mnt``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any

#: System folders and files of the root, where the host has them.
SYSTEM = (
    "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32",
    "/usr/bin", "/bin", "/usr/share/zoneinfo", "/etc/localtime", "/etc/ld.so.cache",
)  # fmt: skip
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: Folders of installed packages, below the bound folders (as globs).
PACKAGES = ("python*/site-packages", "python*/dist-packages", "python*/*/site-packages")

#: Run by the interpreter itself (``-I -S``): its executable, its path, its package folders,
#: and the files it has mapped once it loaded every extension module of its standard library.
_PROBE = r"""
import importlib.machinery, json, os, sys, sysconfig
paths = sysconfig.get_paths()
for folder in sys.path:
    if os.path.basename(folder) == "lib-dynload" and os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                if name.endswith(suffix):
                    try:
                        __import__(name[: -len(suffix)])
                    except BaseException:
                        pass
                    break
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6})
print(json.dumps({
    "executable": os.path.realpath(sys.executable),
    "path": [p for p in sys.path if p],
    "packages": [paths[k] for k in ("purelib", "platlib") if paths.get(k)],
    "mapped": [m for m in mapped if m.startswith("/")],
}))
"""


@dataclass(frozen=True)
class RootView:
    """The program's root. ``binds``: host paths (folders or files, without a symlink in
    them, none inside another), bound read-only at the same path; ``links``: (path,
    target) symlinks re-made as the host has them; ``hidden``: folders inside the binds
    covered by an empty read-only one; ``devices``: device files bound (bwrap makes its own)."""

    binds: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    hidden: tuple[str, ...]
    devices: tuple[str, ...]

    def as_spec(self) -> dict[str, Any]:
        """For the launcher (JSON)."""
        return {
            "binds": list(self.binds),
            "links": [list(pair) for pair in self.links],
            "hidden": list(self.hidden),
            "devices": list(self.devices),
        }


class InterpreterUnusable(RuntimeError):
    """The interpreter could not say what it needs."""


def root_view(python: str) -> RootView:
    """The root for programs run by ``python`` (see the module docstring)."""
    info = _ask(python)
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for path in SYSTEM:
        _place(path, binds, links)
    for path in (info["executable"], *info["path"]):
        if os.path.exists(path):
            binds.append(os.path.realpath(path))
    binds = _outermost(binds)
    for mapped in info["mapped"]:
        real = os.path.realpath(mapped)
        if os.path.isfile(real) and not _inside(real, binds):
            binds.append(real)
            links += _names_of(real)  # libfoo.so.1 -> libfoo.so.1.2.3, as the loader looks it up
    binds = _outermost(binds)
    candidates = [*info["packages"], *(p for b in binds if os.path.isdir(b) for g in PACKAGES for p in glob.glob(f"{b}/{g}"))]
    hidden = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p) and _inside(os.path.realpath(p), binds)})
    devices = tuple(d for d in DEVICES if os.path.exists(d))
    links = [link for link in dict.fromkeys(links) if not _inside(link[0], binds)]  # a bound folder shows those
    return RootView(tuple(binds), tuple(links), tuple(_outermost(hidden)), devices)


def _ask(python: str) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        info = json.loads(done.stdout.strip().splitlines()[-1])
        if not isinstance(info, dict) or not isinstance(info.get("executable"), str):
            raise ValueError(info)
        return info
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        raise InterpreterUnusable(f"{python} could not list what it loads ({type(exc).__name__}: {exc})") from None


def _place(path: str, binds: list[str], links: list[tuple[str, str]]) -> None:
    """A system path as the host has it: a symlink re-made, anything else bound."""
    try:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.exists(path):
            binds.append(os.path.realpath(path))
    except OSError:
        pass


def _names_of(library: str) -> list[tuple[str, str]]:
    """Symlinks beside ``library`` that lead to it."""
    folder = os.path.dirname(library)
    found = []
    try:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.islink(path) and os.path.realpath(path) == library:
                found.append((path, os.readlink(path)))
    except OSError:
        pass
    return found


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without duplicates, without any inside another, never ``/`` itself."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if path != "/" and not _inside(path, kept):
            kept.append(path)
    return kept
