"""The plugin-facing API surface of forgerl, as plain data, and its stored snapshot.

The surface is what a plugin or an embedder may touch (docs/plugins.md, "API stability and
versions"): every public name of the documented modules, each class's public members with
their parameters (names and kinds, not annotations or default values), dataclass and
pydantic fields, the hooks with their parameters and call options, and the build contract.
tests/unit/test_plugin_api_surface.py compares it with the snapshot stored beside that
test (plugin_api_surface.json), so that a plugin-facing name cannot change unnoticed.

After a deliberate change of the plugin API::

    PYTHONPATH=core:plugins .venv/bin/python -m tests.helpers.api_surface --write

rewrites the snapshot; it refuses while the change is not accounted for: a removed or
changed name not named in CHANGELOG.md's newest release, or a PLUGIN_API_VERSION that was
not bumped (MAJOR for a removal or change, MINOR for an addition).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "tests" / "unit" / "plugin_api_surface.json"
CHANGELOG = REPO / "CHANGELOG.md"

#: The documented modules: None for every public name they define (or their ``__all__``),
#: else the names the docs give from a module that is otherwise internal.
PUBLIC: dict[str, tuple[str, ...] | None] = {
    "forgerl": None,
    "forgerl.api": ("load_config", "run", "submit", "plan", "job_scheduler", "Plan", "Submission"),
    "forgerl.interfaces": None,
    "forgerl.types": None,
    "forgerl.hookspecs": ("PROJECT", "hookimpl", "hookspec"),  # the hooks: _hooks()
    "forgerl.options": None,
    "forgerl.environment": None,
    "forgerl.errors": None,
    "forgerl.backends": None,
    "forgerl.contract": None,
    "forgerl.events": ("announce", "phase"),
    "forgerl.loop_thread": ("LoopThread",),
    "forgerl.testing": None,
    "forgerl.testing.timing": ("scaled",),
    "forgerl.testing.registry": ("backend_under_test",),
    "forgerl.testing.generator_support": ("tiny_model",),
    "forgerl.algorithms": ("policy_loss",),
    "forgerl.algorithms.config": ("AlgorithmConfig",),
    "forgerl.configuration.sections": ("SamplingConfig",),
    "forgerl.adapters": ("LoraOptions",),
    "forgerl.rundirs.runs": ("server_role_command",),
    "forgerl.registry.backend_classes": ("record_for_class",),
}

#: Attributes every pydantic model and enum has: not the plugin's business here.
_SKIPPED_MEMBERS = {"model_config", "model_fields", "model_computed_fields"}


def surface() -> dict[str, Any]:
    """The surface of the forgerl importable here."""
    modules: dict[str, dict[str, str | dict[str, Any]]] = {}
    for module_name, names in PUBLIC.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        modules[module_name] = {
            name: describe(getattr(module, name), name) for name in sorted(_public_names(module, names))
        }
    return {"modules": modules, "hooks": _hooks(), "contract": _contract()}


def _public_names(module: Any, names: tuple[str, ...] | None) -> list[str]:
    if names is not None:
        return [n for n in names if hasattr(module, n)]
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "TYPE_CHECKING"
        and _belongs(getattr(value, "__module__", module.__name__), module.__name__)
        and not inspect.ismodule(value)
        and (callable(value) or (isinstance(value, (str, int, float, tuple, frozenset)) and name.isupper()))
    ]


def _belongs(origin: Any, module_name: str) -> bool:
    """Whether a name defined in ``origin`` is ``module_name``'s to promise: defined there,
    or in an internal forgerl module it re-exports (a documented module may become the
    stable face of code that moved into a sub-package). A name imported from another
    documented module is that module's, and a third party's is not forgerl's."""
    if origin == module_name:
        return True
    return isinstance(origin, str) and origin.split(".")[0] == "forgerl" and origin not in PUBLIC


#: Names whose value changes with every release: their type is the promise, not their value.
_VERSIONS = {"__version__", "PLUGIN_API_VERSION"}


def describe(value: Any, name: str = "") -> str | dict[str, Any]:
    """One name of the surface: a class as a dict of its members, anything else as a line."""
    if isinstance(value, type):
        return _class(value)
    if inspect.isroutine(value):
        return _callable(value)
    if isinstance(value, (str, int, float, bool, tuple, frozenset)) and name not in _VERSIONS:
        return f"= {value!r}"
    # An object (pluggy's hookimpl marker, a version): its type, not its library's signature.
    return f": {type(value).__name__}"


def _class(cls: type) -> dict[str, Any]:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    members: dict[str, str] = {}
    # Fields declared by this class: inherited ones are listed under the base.
    own_fields = set(vars(cls).get("__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name in own_fields and not f.name.startswith("_"):
                required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                members[f.name] = "field" if required else "field="
    fields = getattr(cls, "model_fields", None)
    if isinstance(fields, Mapping) and "model_fields" not in vars(cls).get("__annotations__", {}):
        for name, info in fields.items():
            if name in own_fields:
                members[name] = "field=" if not info.is_required() else "field"
    if issubclass(cls, enum.Enum):
        for member in cls:
            members[member.name] = f"= {member.value!r}"
    own = vars(cls)
    for name, value in own.items():
        if name in members or name in _SKIPPED_MEMBERS or (name.startswith("_") and name != "__init__"):
            continue
        if name == "__init__" and (dataclasses.is_dataclass(cls) or fields is not None):
            continue  # the fields are its parameters
        members[name] = _member(value)
    return {"bases": bases, "members": dict(sorted(members.items()))}


def _member(value: Any) -> str:
    # A method a backend must implement: making one abstract breaks every backend without it.
    kind = _member_kind(value)
    return f"abstract {kind}" if getattr(value, "__isabstractmethod__", False) else kind


def _member_kind(value: Any) -> str:
    if isinstance(value, property):
        return "property"
    if isinstance(value, classmethod):
        return "classmethod" + _parameters(value.__func__, skip_first=True)
    if isinstance(value, staticmethod):
        return "staticmethod" + _parameters(value.__func__)
    if isinstance(value, type):
        return "class"
    if callable(value):
        return "def" + _parameters(value, skip_first=True)
    # A class attribute's value is not recorded, only its type: a default is not a name a
    # plugin depends on, and some are facts of the machine (a kit's ``python`` is
    # sys.executable, which differs between checkouts).
    return f": {type(value).__name__}"


def _callable(value: Callable[..., Any]) -> str:
    if hasattr(value, "forgerl_spec"):
        return "hookspec"
    return "def" + _parameters(value)


def _parameters(function: Callable[..., Any], skip_first: bool = False) -> str:
    """``(a, b=, *, c=, **kw)``: names, kinds and which have defaults."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return "(...)"
    if skip_first and parameters:
        parameters = parameters[1:]
    out: list[str] = []
    star = False
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            if p.kind is p.POSITIONAL_ONLY:
                out.append(f"{p.name}/")
            else:
                out.append(p.name + ("=" if p.default is not p.empty else ""))
    return f"({', '.join(out)})"


def _hooks() -> dict[str, str]:
    from forgerl import hookspecs

    hooks = {}
    for name, value in vars(hookspecs).items():
        options = getattr(value, f"{hookspecs.PROJECT}_spec", None)
        if name.startswith("forge_") and options is not None:
            flags = [k for k in ("firstresult", "historic") if options.get(k)]
            hooks[name] = _parameters(value) + (f" [{', '.join(flags)}]" if flags else "")
    return dict(sorted(hooks.items()))


def _contract() -> dict[str, str]:
    try:
        from forgerl.contract import CONTRACT
    except ImportError:
        return {}
    return {what: call.signature for what, call in CONTRACT.items()}


# ------------------------------------------------------------------ comparing


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"modules.forgerl.interfaces.RunContext.members.seed": "field=", ...}`` with the
    paths shortened to what a developer reads: ``forgerl.interfaces.RunContext.seed``."""
    out: dict[str, str] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flatten(value, path))
        elif isinstance(value, list):
            out[path] = ", ".join(value)
        else:
            out[path] = str(value)
    return {_readable(k): v for k, v in out.items()}


def _readable(path: str) -> str:
    path = path.removeprefix("modules.")
    path = path.replace(".members.", ".")
    return re.sub(r"^hooks\.", "hook ", re.sub(r"^contract\.", "build contract: ", path))


@dataclasses.dataclass
class Difference:
    removed: dict[str, str]
    changed: dict[str, tuple[str, str]]
    added: dict[str, str]

    def __bool__(self) -> bool:
        return bool(self.removed or self.changed or self.added)

    def lines(self) -> list[str]:
        out = [f"  removed  {k}  (was {v})" for k, v in self.removed.items()]
        out += [f"  changed  {k}  {old} -> {new}" for k, (old, new) in self.changed.items()]
        out += [f"  added    {k}  {v}" for k, v in self.added.items()]
        return out


def compare(stored: Mapping[str, Any], current: Mapping[str, Any]) -> Difference:
    old, new = flatten(stored), flatten(current)
    return Difference(
        removed={k: old[k] for k in sorted(old.keys() - new.keys())},
        changed={k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]},
        added={k: new[k] for k in sorted(new.keys() - old.keys())},
    )


def load_snapshot() -> dict[str, Any]:
    return dict(json.loads(SNAPSHOT.read_text()))


def newest_release(changelog: str) -> str:
    """The text of CHANGELOG.md's newest release section (``## [X.Y.Z]``, not Unreleased)."""
    sections = re.split(r"(?m)^## ", changelog)
    for section in sections[1:]:
        if not section.startswith("[Unreleased]"):
            return section
    return ""


def unaccounted(difference: Difference, changelog: str) -> list[str]:
    """Removed or changed names the newest CHANGELOG.md release does not mention (by the
    last part of their path: ``RunContext.config`` for ``forgerl.interfaces.RunContext.config``)."""
    release = newest_release(changelog)
    missing = []
    for path in [*difference.removed, *difference.changed]:
        parts = path.split(": ")[-1].removeprefix("hook ").split(".")
        if parts[-1] in ("bases", "__init__"):
            parts = parts[:-1]  # a class's own entries: the class is what the changelog names
        if ".".join(parts[-2:]) not in release and parts[-1] not in release:
            missing.append(path)
    return missing


def required_bump(difference: Difference) -> str | None:
    """"MAJOR" when a name was removed or changed, "MINOR" when names were only added."""
    if difference.removed or difference.changed:
        return "MAJOR"
    return "MINOR" if difference.added else None


def bumped(old: str, new: str, part: str) -> bool:
    (old_major, old_minor), (new_major, new_minor) = (map(int, v.split(".")) for v in (old, new))
    if part == "MAJOR":
        return new_major > old_major
    return (new_major, new_minor) > (old_major, old_minor)


def write(current_version: str) -> list[str]:
    """Rewrite the snapshot; the reasons it refuses to, if any."""
    stored = load_snapshot() if SNAPSHOT.exists() else None
    current = surface()
    if stored is not None:
        difference = compare(stored["surface"], current)
        problems = []
        part = required_bump(difference)
        if part and not bumped(stored["plugin_api"], current_version, part):
            problems.append(
                f"the plugin API changed ({part} change) but PLUGIN_API_VERSION is still "
                f"{current_version} (snapshot: {stored['plugin_api']}): bump it in core/forgerl/api_version.py"
            )
        missing = unaccounted(difference, CHANGELOG.read_text() if CHANGELOG.exists() else "")
        if missing:
            problems.append("CHANGELOG.md's newest release does not mention: " + ", ".join(missing))
        if problems:
            return problems
    SNAPSHOT.write_text(json.dumps({"plugin_api": current_version, "surface": current}, indent=1, sort_keys=True) + "\n")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.api_surface")
    parser.add_argument("--write", action="store_true", help="rewrite the stored snapshot")
    parser.add_argument("--force", action="store_true", help="with --write: even when unaccounted for")
    args = parser.parse_args(argv)
    if not args.write:
        print(json.dumps(surface(), indent=1, sort_keys=True))
        return 0
    from forgerl.api_version import PLUGIN_API_VERSION

    problems = [] if args.force else write(PLUGIN_API_VERSION)
    if args.force:
        SNAPSHOT.write_text(
            json.dumps({"plugin_api": PLUGIN_API_VERSION, "surface": surface()}, indent=1, sort_keys=True) + "\n"
        )
    for problem in problems:
        print(f"api_surface: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
