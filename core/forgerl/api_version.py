"""The version of forgerl's plugin API, and the requirement a plugin may state on it.

The plugin API is everything a plugin touches (docs/plugins.md, "API stability and
versions"): the hooks and their parameters, the interfaces, ``RunContext``, the records and
the build contract, ``forgerl.testing`` and the other documented imports. Its version,
``MAJOR.MINOR``, is not the distribution's: MINOR grows when something is added, MAJOR when
something a plugin may use is removed or changes meaning (a deprecated name is removed no
earlier than the next MAJOR). CHANGELOG.md says what changed in each.

A plugin states the versions it was written for in its entry-point module::

    FORGERL_PLUGIN_API = ">=1.0,<2"

(comma-separated clauses of ``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=`` or ``~=`` and a
``MAJOR`` or ``MAJOR.MINOR`` version, as pip writes requirements). A plugin whose
requirement this forgerl does not meet is not loaded: one line names it, what it requires
and what is installed (a warning, an error under ``FORGE_STRICT_PLUGINS=1``), instead of a
failure deep in a run. pip's ``Requires-Dist: forgerl>=...`` still says which distribution
to install; this says which contract the code was written against, and holds however the
plugin got onto ``sys.path`` (an editable install, ``--no-deps``, ``FORGE_PLUGINS``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

#: The plugin API this forgerl provides.
PLUGIN_API_VERSION = "1.3"

#: The module attribute in which a plugin states the plugin API versions it works with.
REQUIREMENT_ATTRIBUTE = "FORGERL_PLUGIN_API"

_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|~=|>|<)\s*(\d+)(?:\.(\d+|\*))?\s*$")
_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq, "!=": operator.ne,
}  # fmt: skip

Version = tuple[int, int]


def parse_version(text: str) -> Version:
    """``"1.0"`` -> ``(1, 0)``; ``"2"`` -> ``(2, 0)``."""
    major, _, minor = text.strip().partition(".")
    return int(major), int(minor or 0)


def _clause_holds(clause: str, version: Version) -> bool:
    match = _CLAUSE.match(clause)
    if match is None:
        raise ValueError(f"{clause.strip()!r} is not a clause such as '>=1.0' or '<2'")
    op, major, minor = match.group(1), int(match.group(2)), match.group(3)
    if minor == "*":
        # ``==1.*`` / ``!=1.*``: any minor of that major (pip's prefix match).
        if op not in ("==", "!="):
            raise ValueError(f"{clause.strip()!r}: a wildcard goes with == or != only")
        return (version[0] == major) == (op == "==")
    wanted = (major, int(minor or 0))
    if op == "~=":
        # Compatible release, as pip reads it: ``~=1.2`` is ``>=1.2,<2``.
        if minor is None:
            raise ValueError(f"{clause.strip()!r}: ~= needs MAJOR.MINOR, e.g. '~=1.0'")
        return version >= wanted and version[0] == major
    return _OPERATORS[op](version, wanted)


def satisfies(requirement: str, version: str = PLUGIN_API_VERSION) -> bool:
    """Whether plugin API ``version`` meets ``requirement`` (every clause holds); raises
    ValueError naming the clause that cannot be read."""
    clauses = [c for c in requirement.split(",") if c.strip()]
    if not clauses:
        raise ValueError("it names no version")
    have = parse_version(version)
    return all([_clause_holds(c, have) for c in clauses])  # every clause parsed, even after a miss


def requirement_problem(plugin: Any) -> str | None:
    """None when ``plugin`` (a module or object) states no requirement or one this forgerl
    meets; else why it cannot be loaded, as the rest of a line that starts with its name."""
    required = getattr(plugin, REQUIREMENT_ATTRIBUTE, None)
    if required is None:
        return None
    if not isinstance(required, str):
        return (
            f"states {REQUIREMENT_ATTRIBUTE} = {required!r}, which is not a version requirement "
            f"such as '>=1.0,<2': fix the plugin"
        )
    try:
        met = satisfies(required)
    except ValueError as exc:
        return f"states {REQUIREMENT_ATTRIBUTE} = {required!r}, which cannot be read ({exc}): fix the plugin"
    if met:
        return None
    return (
        f"requires the forgerl plugin API {required} but this forgerl{_installed()} provides "
        f"{PLUGIN_API_VERSION}: install a release of the plugin for plugin API {PLUGIN_API_VERSION} "
        "or a forgerl that provides what it requires (CHANGELOG.md lists what changed)"
    )


def _installed() -> str:
    """`` (0.2.0)``: the installed distribution's version, read from its metadata (the
    package's ``__version__`` would make this module import the package that imports it)."""
    from importlib import metadata

    try:
        return f" ({metadata.version('forgerl')})"
    except metadata.PackageNotFoundError:
        return ""
