"""Plugin-facing names on their way out: what replaces each, and how a use is reported.

A name removed or renamed in the plugin API keeps working for one release: its use warns
(:class:`ForgeDeprecationWarning`) naming the plugin that used it and the replacement; a
run's processes copy it into the run's events, so ``forge run`` prints it however deep in
the run it happened. Where the old name cannot work any more, its use raises
:class:`~forgerl.errors.PluginAPIError`: one line with the same facts, exit status 2.
:data:`DEPRECATED` and :data:`REMOVED` are the one list of both; CHANGELOG.md describes
each (a test checks).

The warning is a FutureWarning, not a DeprecationWarning: Python hides DeprecationWarning
unless the code that triggers it runs in ``__main__``, and here it is triggered in a
plugin's module inside a trainer rank, seen (if at all) by a user who installed the
plugin, not by its author. pytest shows both kinds, so plugin authors see it in their
tests too, and ``-W error::forgerl.deprecation.ForgeDeprecationWarning`` fails them.
"""

from __future__ import annotations

import sys
import warnings

from forgerl.errors import PluginAPIError

#: The release that deprecated the names below, and the plugin API that will drop them.
SINCE = "forgerl 0.2.0"
REMOVED_IN = "plugin API 2.0"

_FACTS = (
    "the run's facts on the context instead (context.transport_timeout, .seed, .dtype, .temperature, "
    ".sampling, .algorithm, .model_name, .max_staleness, .adapter) and the backend's own options"
)

#: Deprecated name -> what to use instead. Each still works, with a warning.
DEPRECATED: dict[str, str] = {
    "RunContext.config": f"read {_FACTS}",
    **{
        f"forgerl.contract.{name}": (
            "annotate with the backend's class or interface; the call forgerl makes is in "
            "forgerl.contract.CONTRACT"
        )
        for name in (
            "GeneratorFactory", "GeneratorRoles", "TrainerFactory", "TransportFactory",
            "TaskFactory", "RewardFactory", "SchedulerFactory", "ModelFactory",
        )
    },
}  # fmt: skip

#: Removed name -> what to use instead. A use is refused in one line.
REMOVED: dict[str, str] = {
    "RunContext.extras": "a generator gets its transport as the build argument `transport`: "
    "factory(options, *, context, transport)",
}


class ForgeDeprecationWarning(FutureWarning):
    """A plugin used a name of the plugin API that a later release removes."""


#: Plugin module or package name -> "plugin 'NAME' (DISTRIBUTION VERSION)", filled as
#: plugins are registered, so that a warning says whose code used the old name.
_PLUGIN_MODULES: dict[str, str] = {}


def remember_plugin(module_name: str, label: str) -> None:
    """Note that code under ``module_name`` (a plugin's module, and its package) is
    ``label``'s."""
    _PLUGIN_MODULES.setdefault(module_name, label)
    package = module_name.rpartition(".")[0]
    if package:
        _PLUGIN_MODULES.setdefault(package, label)


def whose(module_name: str) -> str:
    """The plugin that ``module_name`` belongs to, as messages name it."""
    parts = module_name.split(".")
    for end in range(len(parts), 0, -1):
        label = _PLUGIN_MODULES.get(".".join(parts[:end]))
        if label is not None:
            return label
    return f"module {module_name}"


def _caller(stacklevel: int) -> str:
    try:
        frame = sys._getframe(stacklevel + 1)
    except ValueError:  # called from the top of the stack
        return "unknown"
    return str(frame.f_globals.get("__name__", "unknown"))


def warn_deprecated(name: str, *, stacklevel: int = 2) -> None:
    """Warn that the code ``stacklevel`` frames up (as :func:`warnings.warn` counts) used
    the deprecated ``name`` (a key of :data:`DEPRECATED`). A run's processes also copy
    the warning into the run's events (:func:`forgerl.events.forward_warnings`)."""
    module = _caller(stacklevel)
    message = (
        f"{whose(module)} uses {name} (in {module}), deprecated since {SINCE} and removed in {REMOVED_IN}: "
        f"{DEPRECATED[name]}; see forgerl's CHANGELOG.md"
    )
    warnings.warn(message, ForgeDeprecationWarning, stacklevel=stacklevel + 1)


def removed(name: str, *, stacklevel: int = 2, reason: str = "") -> PluginAPIError:
    """The error for a use of ``name`` (a key of :data:`REMOVED`, or of :data:`DEPRECATED`
    with the ``reason`` it cannot work here) by the code ``stacklevel`` frames up; the
    caller raises it."""
    module = _caller(stacklevel)
    instead = REMOVED.get(name) or DEPRECATED[name]
    return PluginAPIError(
        f"{whose(module)} uses {name} (in {module}), {reason or 'which this plugin API no longer has'}: "
        f"{instead}; see forgerl's CHANGELOG.md, and upgrade the plugin"
    )
