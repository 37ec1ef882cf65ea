"""What goes wrong with plugins, and the one line that tells the user what to do about it.

A third-party plugin that fails is skipped with a warning (an error under
``FORGE_STRICT_PLUGINS=1``) so that one bad install does not break every ``forge``
command; a built-in plugin that fails is a bug in forgerl and always an error.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from forgerl import hookspecs
from forgerl.backends import Backend
from forgerl.errors import BrokenPlugin, PluginError
from forgerl.registry.backend_classes import record_for_class
from forgerl.registry.plugin_info import PluginInfo


def warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr)


def broken(info: PluginInfo, why: str, strict: bool, exc: BaseException | None = None) -> None:
    """Mark ``info`` broken and say so: a warning, or an error when the plugin is built in
    (a bug), named explicitly by the caller, or ``strict``."""
    info.status = "broken"
    info.error = why
    message = f"{info.label} {why}"
    if info.first_party:
        # A broken built-in plugin is a bug in forgerl, not something to skip quietly.
        raise PluginError(message) from exc
    if strict or info.explicit:
        # Named by the caller (an import path, an object), or strict: the user asked for it.
        raise BrokenPlugin(message) from exc
    warn(message + " (it is skipped; FORGE_STRICT_PLUGINS=1 makes this an error)")


# ------------------------------------------------------------------ backend name clashes


@dataclass
class BackendClash:
    """One backend name claimed by more than one plugin. No record of it is used: which one
    a run would get must not depend on install order. The fix keeps the built-in one."""

    kind: str
    name: str
    providers: list[PluginInfo]

    @property
    def newcomers(self) -> list[PluginInfo]:
        """Who should step aside: the third-party providers when a built-in plugin is
        among them (disabling the built-in one would drop all its other backends too)."""
        unique = _unique(self.providers)
        third_party = [p for p in unique if not p.first_party]
        return third_party if len(third_party) < len(unique) else []

    @property
    def fix(self) -> str:
        unique = _unique(self.providers)
        if len(unique) == 1:
            return (
                f"A bug in that plugin: upgrade it, or disable it with FORGE_DISABLE_PLUGINS={unique[0].name}"
            )
        if self.newcomers:
            names = ",".join(p.name for p in self.newcomers)
            dists = " and ".join(sorted({p.distribution for p in self.newcomers}))
            return (
                f"To keep forgerl's, disable the newcomer with FORGE_DISABLE_PLUGINS={names} "
                f"(or uninstall {dists})"
            )
        options = " or ".join(f"FORGE_DISABLE_PLUGINS={p.name}" for p in unique)
        return f"Uninstall one, or disable one with {options}"

    def message(self) -> str:
        unique = _unique(self.providers)
        if len(unique) == 1:
            return f"{self.kind} {self.name!r} is provided twice by {unique[0].label}. {self.fix}."
        who = " and by ".join(p.label for p in unique)
        return f"{self.kind} {self.name!r} is provided twice: by {who}. {self.fix}."

    def reason_for(self, info: PluginInfo) -> str:
        """Why ``info``'s record of this name is unusable, for ``forge plugins list``."""
        others = [p.label for p in _unique(self.providers) if p is not info] or ["itself"]
        return f"also provided by {', '.join(others)}. {self.fix}"


def _unique(infos: Iterable[PluginInfo]) -> list[PluginInfo]:
    """Each plugin once (a plugin may claim a name twice itself), built-in ones first."""
    seen: list[PluginInfo] = []
    for info in infos:
        if not any(info is s for s in seen):
            seen.append(info)
    return sorted(seen, key=lambda p: not p.first_party)


# ------------------------------------------------------------------ hooks and records


def unknown_hooks(names: list[str]) -> str:
    """'implements an unknown hook forge_step_ends (did you mean forge_step_end?)'."""
    known = sorted(n for n in vars(hookspecs) if n.startswith("forge_") and callable(getattr(hookspecs, n)))
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    what = "an unknown hook" if len(names) == 1 else "unknown hooks"
    text = f"implements {what} {', '.join(parts)}"
    if not any("did you mean" in p for p in parts):
        text += f"; the hooks are: {', '.join(known)}"
    return text


def checked_records(
    hook: str,
    expected: type[Backend],
    results: Iterable[Any],
    record_of: Callable[[type[Backend], Any, str], Backend] = record_for_class,
) -> list[Backend]:
    """The records one plugin's registration ``hook`` returned (pluggy gives one result per
    implementation), each checked to be an ``expected`` record; ``record_of`` makes the
    record of a backend class (the listing's reads the class's identity from an index)."""
    records: list[Backend] = []
    for result in results:
        if result is None:
            continue
        if isinstance(result, (Backend, str, bytes, Mapping)) or not isinstance(result, Iterable):
            raise PluginError(
                f"{hook} returned {type(result).__name__}; expected a list of {expected.__name__}"
            )
        for record in result:
            if isinstance(record, (str, type)):
                # One backend, one class (forgerl.registry.backend_classes): the class, or "module:Class".
                record = record_of(expected, record, hook)
            if not isinstance(record, expected):
                raise PluginError(
                    f"{hook} returned {type(record).__name__}; expected {expected.__name__} or a backend class"
                )
            records.append(record)
    return records


def registration_failure(hook: str, exc: Exception) -> str:
    if isinstance(exc, PluginError):
        return f"registers something wrong: {exc}"
    return f"failed in {hook}: {type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ FORGE_DISABLE_PLUGINS


def warn_unmatched_disabled(disabled: set[str], source: str, plugins: Mapping[str, PluginInfo]) -> None:
    """A name in FORGE_DISABLE_PLUGINS that matches no plugin blocks nothing: most likely a
    typo, or a backend's name where its plugin's is meant."""
    names = sorted({info.name for info in plugins.values()})
    unmatched = sorted(disabled - set(names))
    if not unmatched:
        return
    owners = {b.name: info for info in plugins.values() for b in info.backends}
    notes = []
    for name in unmatched:
        close = difflib.get_close_matches(name, names, n=1)
        if name in owners:
            notes.append(f"{name!r} (a backend of {owners[name].label})")
        elif close:
            notes.append(f"{name!r} (did you mean {close[0]!r}?)")
        else:
            notes.append(repr(name))
    warn(f"{source} names no installed plugin: {', '.join(notes)}; the plugins are: {', '.join(names)}")
