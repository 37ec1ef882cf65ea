"""Finding plugins and the backends they provide.

Plugins come from entry points in the ``forgerl`` group (built-in ones included) and,
when embedding, from objects passed in. Environment switches:

- ``FORGE_DISABLE_PLUGINS=a,b``  never load these plugins (entry-point names); a name that
  matches no plugin is a warning
- ``FORGE_STRICT_PLUGINS=1``     a third-party plugin that fails to load, requires a plugin
  API this forgerl does not provide (``FORGERL_PLUGIN_API``, :mod:`forgerl.api_version`),
  implements an unknown hook, registers something wrong or claims a backend name another
  plugin has is an error (one line, exit 2), not a warning
- ``FORGE_TRACE_HOOKS=1``        print every hook call to stderr
- ``FORGE_PLUGINS=pkg.mod,...``  also load these modules as plugins (set for a run's
  processes when the embedding code passed plugins by import path)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import pluggy

from forgerl import hookspecs
from forgerl.api_version import PLUGIN_API_VERSION, requirement_problem
from forgerl.backends import BACKEND_KINDS, Backend
from forgerl.configuration.env import env_flag
from forgerl.configuration.kinds import KINDS, REGISTRATION_HOOKS
from forgerl.deprecation import remember_plugin
from forgerl.errors import (
    BackendUnavailable,
    DuplicateBackend,
    PluginLoadError,
    TransportError,
    UnknownBackend,
)
from forgerl.registry.backend_classes import record_for_class
from forgerl.registry.backend_index import BackendIndex
from forgerl.registry.plugin_info import EXPLICIT_OBJECT, EXPLICIT_REF, FIRST_PARTY_DIST, PluginInfo
from forgerl.registry.plugin_problems import (
    BackendClash,
    broken,
    checked_records,
    registration_failure,
    unknown_hooks,
    warn_unmatched_disabled,
)

ENTRY_POINT_GROUP = "forgerl"


def _env_list_ordered(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").split(",") if p.strip()]


def _env_list(name: str) -> set[str]:
    return {p.strip() for p in os.environ.get(name, "").split(",") if p.strip()}


class Registry:
    """The plugin manager plus every backend, by kind and name.

    Build it with :func:`build_registry`. Backends are collected once, when first asked
    for: collecting imports every backend class's module, which a command that needs no
    backend (``forge --help``, ``forge status``) is spared, and so is ``forge plugins
    list`` while the index of the classes' identities is up to date (:meth:`listing`).
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        plugins: dict[str, PluginInfo],
        refs: list[str] | None = None,
        *,
        strict: bool = False,
    ):
        self.pm = pm
        self._plugins = plugins
        #: Plugins given by import path: a run's processes load them too (FORGE_PLUGINS).
        self.plugin_refs = list(refs or [])
        self._backends: dict[str, dict[str, Backend]] = {kind: {} for kind in KINDS}
        self._owner: dict[tuple[str, str], PluginInfo] = {}
        self._clashes: dict[tuple[str, str], BackendClash] = {}
        self._strict = strict
        self._collected = False

    @property
    def plugins(self) -> dict[str, PluginInfo]:
        """Every plugin found, with the backends it registered."""
        self._collect_once()
        return self._plugins

    # -------------------------------------------------------------- collection

    def listing(self) -> dict[str, PluginInfo]:
        """:attr:`plugins`, for showing them (``forge plugins list``): the identity of a
        backend class comes from the index (:mod:`forgerl.registry.backend_index`) when it is up to
        date, and its module is imported only when the backend is first built. A class
        that fails to import or to pass the checks is never in the index, so a broken
        plugin is reported as by :attr:`plugins`."""
        if not self._collected:
            self._collected = True
            index = BackendIndex.load()
            self._collect(self._strict, index.record)
            index.save()
        return self._plugins

    def _collect_once(self) -> None:
        if not self._collected:
            self._collected = True
            self._collect(self._strict)

    def _collect(
        self, strict: bool, record_of: Callable[[type[Backend], Any, str], Backend] = record_for_class
    ) -> None:
        """Ask every plugin for its backends. A plugin whose registration hook raises or
        returns something that is not a record of its kind is dropped whole, like one
        that fails to import; a name two plugins claim is recorded as a clash."""
        offered: dict[str, list[tuple[str, Any]]] = {}
        failed: dict[str, tuple[str, BaseException]] = {}
        for kind, hook_name in REGISTRATION_HOOKS.items():
            for plugin_name, call in self._registration_calls(hook_name):
                if plugin_name in failed:
                    continue
                try:
                    label = self._plugins[plugin_name].label
                    records = [
                        dataclasses.replace(record, provider=label)
                        for record in checked_records(hook_name, BACKEND_KINDS[kind], call(), record_of)
                    ]
                except Exception as exc:  # noqa: BLE001 - a plugin's registration code failed
                    failed[plugin_name] = (registration_failure(hook_name, exc), exc)
                    continue
                offered.setdefault(plugin_name, []).extend((kind, r) for r in records)
        for plugin_name, (why, error) in failed.items():
            info = self._plugins[plugin_name]
            self.pm.unregister(name=plugin_name)  # its event hooks must not run either
            info.hooks = []
            broken(info, why, strict, error)
        for plugin_name, kinds_and_records in offered.items():
            if plugin_name not in failed:
                for kind, record in kinds_and_records:
                    self._add(kind, record, self._plugins[plugin_name])
        if strict and self._clashes:
            raise DuplicateBackend(next(iter(self._clashes.values())).message())

    def _registration_calls(self, hook_name: str) -> Iterable[tuple[str, Any]]:
        """A registration hook, callable plugin by plugin, so that each record is attributed
        to the plugin (and so the distribution) that returned it; goes through pluggy's
        normal call path, so FORGE_TRACE_HOOKS shows these calls too."""
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            others = [p for p in self.pm.get_plugins() if p is not impl.plugin]
            yield impl.plugin_name, self.pm.subset_hook_caller(hook_name, remove_plugins=others)

    def _add(self, kind: str, record: Backend, info: PluginInfo) -> None:
        info.backends.append(record)
        key = (kind, record.name)
        holder = self._owner.get(key)
        if holder is not None:
            clash = self._clashes.setdefault(key, BackendClash(kind, record.name, [holder]))
            clash.providers.append(info)
            if holder.first_party or not info.first_party:
                return  # the built-in record stays the one listed (it is not used either)
        self._backends[kind][record.name] = record
        self._owner[key] = info

    # ------------------------------------------------------------------ lookup

    @property
    def kinds(self) -> list[str]:
        return list(KINDS)

    def backends(self, kind: str) -> dict[str, Backend]:
        self._collect_once()
        return dict(self._backends[kind])

    def owner(self, kind: str, name: str) -> PluginInfo:
        self._collect_once()
        return self._owner[(kind, name)]

    def get(self, kind: str, name: str) -> Backend:
        """The record of backend ``name``, available or not; UnknownBackend if none,
        DuplicateBackend if two plugins claim it."""
        self._collect_once()
        clash = self._clashes.get((kind, name))
        if clash is not None:
            raise DuplicateBackend(clash.message())
        try:
            return self._backends[kind][name]
        except KeyError:
            installed = ", ".join(sorted(self._backends[kind])) or "none"
            raise UnknownBackend(
                f"no {kind} {name!r}; installed: {installed}. See `forge plugins list`."
            ) from None

    @property
    def clashes(self) -> list[BackendClash]:
        """Backend names more than one plugin claims (none of their records is used)."""
        self._collect_once()
        return list(self._clashes.values())

    def clash(self, kind: str, name: str) -> BackendClash | None:
        self._collect_once()
        return self._clashes.get((kind, name))

    def require(self, kind: str, name: str) -> Backend:
        """Like :meth:`get`, but raises BackendUnavailable when it cannot run here."""
        backend = self.get(kind, name)
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"{kind} {name!r} is unavailable: {reason}")
        return backend

    def transport_from(self, description: Mapping[str, Any]) -> Any:
        """The transport another process described (:meth:`Transport.describe`), built
        here outside a run (``context=None``); a description of another format or version
        is refused in one line."""
        from forgerl.interfaces import TRANSPORT_FORMAT, TRANSPORT_VERSION

        got = (description.get("format"), description.get("version"))
        if got != (TRANSPORT_FORMAT, TRANSPORT_VERSION):
            raise TransportError(
                f"a transport description of format {got[0]!r} version {got[1]!r}; this forgerl reads "
                f"{TRANSPORT_FORMAT!r} version {TRANSPORT_VERSION}: the two processes run different forgerl versions"
            )
        return self.require("transport", str(description["name"])).build(description.get("options") or {}, context=None)

    def available(self, kind: str) -> list[str]:
        self._collect_once()
        return [
            n
            for n, b in self._backends[kind].items()
            if (kind, n) not in self._clashes and b.unavailable_reason() is None
        ]

    # ------------------------------------------------------------------ events

    @property
    def hooks(self) -> Hooks:
        return Hooks(self.pm)


class Hooks:
    """Typed facade over ``pm.hook`` for the event hooks, so core never sees pluggy's Any."""

    def __init__(self, pm: pluggy.PluginManager):
        self._hook = pm.hook

    def run_start(self, config: Any, run_dir: Any) -> None:
        self._hook.forge_run_start(config=config, run_dir=run_dir)

    def step_end(self, step: int, metrics: Mapping[str, float], run_dir: Any) -> None:
        self._hook.forge_step_end(step=step, metrics=metrics, run_dir=run_dir)

    def step_samples(self, step: int, samples: Any, run_dir: Any) -> None:
        self._hook.forge_step_samples(step=step, samples=samples, run_dir=run_dir)

    def run_end(self, summary: Mapping[str, Any], run_dir: Any) -> None:
        self._hook.forge_run_end(summary=summary, run_dir=run_dir)

    def commands(self, cli: Any) -> None:
        self._hook.forge_commands(cli=cli)


def build_registry(
    *,
    plugins: Iterable[Any] = (),
    entry_points: bool = True,
    disabled: Iterable[str] | None = None,
    strict: bool | None = None,
    trace: bool | None = None,
    collect: bool = True,
) -> Registry:
    """Load plugins and collect their backends.

    ``plugins`` are extra plugins to register when embedding forgerl: import paths
    (``"pkg.module"``), which a run's processes load too, or objects (modules or
    instances), which exist in this process only. A plugin's name is its import path, or
    its ``forge_plugin_name``/``__name__``. ``disabled``/``strict``/``trace`` default to
    the environment switches. ``collect=False`` leaves collecting the backends (importing
    their classes' modules, reporting what is wrong with them) to their first use: the
    command line does so, since most of its commands use none.
    """
    disabled_from = "FORGE_DISABLE_PLUGINS" if disabled is None else "disabled"
    disabled = set(disabled) if disabled is not None else _env_list("FORGE_DISABLE_PLUGINS")
    strict = env_flag("FORGE_STRICT_PLUGINS") if strict is None else strict
    trace = env_flag("FORGE_TRACE_HOOKS") if trace is None else trace

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if trace:
        pm.trace.root.setwriter(lambda s: sys.stderr.write(s))
        pm.enable_tracing()

    infos: dict[str, PluginInfo] = {}
    if entry_points:
        for ep, dist, version, shadowed_by in _entry_points():
            info = PluginInfo(ep.name, dist, version)
            if shadowed_by is not None:
                # Two distributions use one plugin name: keep one (the built-in one if it
                # is among them) so that every other plugin still works; the other is
                # listed under "NAME (DISTRIBUTION)".
                infos[f"{ep.name} ({dist})"] = info
                if ep.name in disabled:
                    info.status = "blocked"
                else:
                    why = f"is not loaded: {shadowed_by.label} has the same name; uninstall one"
                    broken(info, why, strict)
                continue
            infos[ep.name] = info
            if ep.name in disabled:
                info.status = "blocked"
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure of a plugin
                broken(info, f"failed to load: {type(exc).__name__}: {exc}{_api_hint(exc)}", strict, exc)
                continue
            _register(pm, obj, info, strict)

    refs = [r for r in _env_list_ordered("FORGE_PLUGINS")]
    refs += [p for p in plugins if isinstance(p, str) and p not in refs]
    for ref in refs:
        info = infos[ref] = PluginInfo(ref, EXPLICIT_REF, "")
        if ref in disabled:
            info.status = "blocked"
            continue
        try:
            obj = importlib.import_module(ref)
        except Exception as exc:
            # Named explicitly by the user: failing to load it is always an error.
            raise PluginLoadError(
                f"plugin {ref!r} failed to load: {type(exc).__name__}: {exc}; check the import path"
            ) from exc
        _register(pm, obj, info, strict)
    objects = [p for p in plugins if not isinstance(p, str)]
    for obj in objects:
        name = getattr(obj, "forge_plugin_name", None) or getattr(obj, "__name__", None) or type(obj).__name__
        info = infos[name] = PluginInfo(name, EXPLICIT_OBJECT, "")
        if name in disabled:
            info.status = "blocked"
            continue
        _register(pm, obj, info, strict)

    _check_pending(pm, infos, strict)
    for name, info in infos.items():
        plugin = pm.get_plugin(name)
        if plugin is not None:
            info.hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
    registry = Registry(pm, infos, refs, strict=strict)
    if collect or strict:  # a strict registry fails at once, not at first use
        registry.plugins  # noqa: B018 - collects the backends
    if disabled - {info.name for info in infos.values()}:
        # The warning names the backends of the plugins (a backend's name given for its plugin's).
        warn_unmatched_disabled(disabled, disabled_from, registry.plugins)
    return registry


def _entry_points() -> list[tuple[Any, str, str, PluginInfo | None]]:
    """The ``forgerl`` entry points by name, each with its distribution's name and version
    and the plugin that shadows it when another distribution uses the same name (built-in
    first, else the first by distribution)."""
    by_name: dict[str, list[tuple[Any, str, str]]] = {}
    read: dict[int, tuple[str, str]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(ep.name, []).append((ep, *_distribution(ep, read)))
    out: list[tuple[Any, str, str, PluginInfo | None]] = []
    for name in sorted(by_name):
        eps = sorted(by_name[name], key=lambda e: (e[1] != FIRST_PARTY_DIST, e[1]))
        kept, kept_dist, kept_version = eps[0]
        out.append((kept, kept_dist, kept_version, None))
        holder = PluginInfo(name, kept_dist, kept_version)
        out += [(ep, d, v, holder) for ep, d, v in eps[1:] if (d, ep.value) != (kept_dist, kept.value)]
    return out


def _distribution(ep: Any, read: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """The name and version of the distribution providing ``ep``, read once per
    distribution (its entry points share one object, alive while ``read`` is used): each
    read of a name or version parses the whole METADATA file, README included, and
    reading them at every use took 133 parses, about a third of ``forge --help``."""
    dist = ep.dist
    if dist is None:
        return "unknown", "?"
    if id(dist) not in read:
        meta = dist.metadata
        read[id(dist)] = (meta["Name"], meta["Version"])
    return read[id(dist)]


def _register(pm: pluggy.PluginManager, obj: Any, info: PluginInfo, strict: bool) -> None:
    # A plugin that states the plugin API it was written for (FORGERL_PLUGIN_API) and
    # finds another is not loaded: one line now, not a failure deep in a run.
    problem = requirement_problem(obj)
    if problem is not None:
        broken(info, problem, strict)
        return
    remember_plugin(obj.__name__ if inspect.ismodule(obj) else type(obj).__module__, info.label)
    try:
        pm.register(obj, name=info.name)
    except pluggy.PluginValidationError as exc:
        # A hook implementation whose arguments do not fit its spec.
        broken(info, f"does not fit a hook: {exc}", strict, exc)
    except ValueError as exc:
        # The same module under two entry-point names, or a name taken by an embedded object.
        broken(info, f"cannot be registered: {exc}", strict, exc)


def _api_hint(exc: BaseException) -> str:
    """For a plugin that imports a forgerl name this forgerl lacks: most likely it was
    written for another plugin API, and the changelog says what replaced the name."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if not (isinstance(missing, str) and missing.split(".")[0] == "forgerl"):
        return ""
    return (
        f" (the plugin may be written for another forgerl: this one provides plugin API "
        f"{PLUGIN_API_VERSION}; forgerl's CHANGELOG.md says what replaced the name)"
    )


def _check_pending(pm: pluggy.PluginManager, infos: dict[str, PluginInfo], strict: bool) -> None:
    """pluggy's check_pending, one offender at a time: a hook implementation whose name
    matches no spec (a typo) must fail loudly instead of silently never running."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin) or str(exc.plugin)
            info = infos.get(name) or PluginInfo(name, EXPLICIT_OBJECT, "")
            unknown = sorted(c.name for c in pm.get_hookcallers(exc.plugin) or () if not c.has_spec())
            pm.unregister(exc.plugin)
            broken(info, unknown_hooks(unknown), strict, exc)
