"""Finding plugins and the backends they provide.

Plugins come from entry points in the ``forgerl`` group (built-in ones included) and,
when embedding, from objects passed in. Environment switches:

- ``FORGE_DISABLE_PLUGINS=a,b``  never load these plugins (entry-point names)
- ``FORGE_STRICT_PLUGINS=1``     a plugin that fails to load is an error, not a warning
- ``FORGE_TRACE_HOOKS=1``        print every hook call to stderr
- ``FORGE_PLUGINS=pkg.mod,...``  also load these modules as plugins (set for a run's
  processes when the embedding code passed plugins by import path)
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable, Mapping

import pluggy

from forgerl import hookspecs
from forgerl.backends import BACKEND_KINDS, Backend
from forgerl.errors import BackendUnavailable, DuplicateBackend, PluginError, PluginLoadError, UnknownBackend

ENTRY_POINT_GROUP = "forgerl"
FIRST_PARTY_DIST = "forgerl"

# kind -> name of the hook that registers backends of that kind
_KIND_HOOKS = {
    "generator": "forge_generators",
    "trainer": "forge_trainers",
    "reward": "forge_rewards",
    "transport": "forge_transports",
    "scheduler": "forge_schedulers",
    "task": "forge_tasks",
    "model": "forge_models",
}


@dataclass
class PluginInfo:
    """What ``forge plugins list`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    status: str = "loaded"  # loaded | blocked | broken
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)

    @property
    def first_party(self) -> bool:
        return self.distribution == FIRST_PARTY_DIST


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _env_list_ordered(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").split(",") if p.strip()]


def _env_list(name: str) -> set[str]:
    return {p.strip() for p in os.environ.get(name, "").split(",") if p.strip()}


def _warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr)


class Registry:
    """The plugin manager plus every backend, by kind and name.

    Build it with :func:`build_registry`. Backends are collected once, when built.
    """

    def __init__(self, pm: pluggy.PluginManager, plugins: dict[str, PluginInfo], refs: list[str] | None = None):
        self.pm = pm
        self.plugins = plugins
        #: Plugins given by import path: a run's processes load them too (FORGE_PLUGINS).
        self.plugin_refs = list(refs or [])
        self._backends: dict[str, dict[str, Backend]] = {kind: {} for kind in _KIND_HOOKS}
        self._owner: dict[tuple[str, str], PluginInfo] = {}
        self._collect()

    # -------------------------------------------------------------- collection

    def _collect(self) -> None:
        for kind, hook_name in _KIND_HOOKS.items():
            for plugin_name, records in self._call_per_plugin(hook_name):
                info = self.plugins[plugin_name]
                for record in records or ():
                    self._add(kind, record, info)

    def _call_per_plugin(self, hook_name: str) -> Iterable[tuple[str, Any]]:
        """Call a registration hook plugin by plugin, so that each record is attributed to
        the plugin (and so the distribution) that returned it; goes through pluggy's
        normal call path, so FORGE_TRACE_HOOKS shows these calls too."""
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            others = [p for p in self.pm.get_plugins() if p is not impl.plugin]
            subset = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
            for result in subset():
                yield impl.plugin_name, result

    def _add(self, kind: str, record: Any, info: PluginInfo) -> None:
        expected = BACKEND_KINDS[kind]
        if not isinstance(record, expected):
            raise PluginError(
                f"plugin {info.name!r} ({info.distribution} {info.version}) returned "
                f"{type(record).__name__} from {_KIND_HOOKS[kind]}; expected {expected.__name__}"
            )
        existing = self._backends[kind].get(record.name)
        if existing is not None:
            other = self._owner[(kind, record.name)]
            raise DuplicateBackend(
                f"{kind} {record.name!r} is provided twice: by {other.distribution} {other.version} "
                f"(plugin {other.name!r}) and by {info.distribution} {info.version} "
                f"(plugin {info.name!r}). Uninstall one, or block one with "
                f"FORGE_DISABLE_PLUGINS={info.name}."
            )
        self._backends[kind][record.name] = record
        self._owner[(kind, record.name)] = info
        info.backends.append(record)

    # ------------------------------------------------------------------ lookup

    @property
    def kinds(self) -> list[str]:
        return list(_KIND_HOOKS)

    def backends(self, kind: str) -> dict[str, Backend]:
        return dict(self._backends[kind])

    def owner(self, kind: str, name: str) -> PluginInfo:
        return self._owner[(kind, name)]

    def get(self, kind: str, name: str) -> Backend:
        """The record of backend ``name``, available or not; UnknownBackend if none."""
        try:
            return self._backends[kind][name]
        except KeyError:
            installed = ", ".join(sorted(self._backends[kind])) or "none"
            raise UnknownBackend(
                f"no {kind} {name!r}; installed: {installed}. See `forge plugins list`."
            ) from None

    def require(self, kind: str, name: str) -> Backend:
        """Like :meth:`get`, but raises BackendUnavailable when it cannot run here."""
        backend = self.get(kind, name)
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"{kind} {name!r} is unavailable: {reason}")
        return backend

    def available(self, kind: str) -> list[str]:
        return [n for n, b in self._backends[kind].items() if b.unavailable_reason() is None]

    # ------------------------------------------------------------------ events

    @property
    def hooks(self) -> "Hooks":
        return Hooks(self.pm)


class Hooks:
    """Typed facade over ``pm.hook`` for the event hooks, so core never sees pluggy's Any."""

    def __init__(self, pm: pluggy.PluginManager):
        self._hook = pm.hook

    def run_start(self, config: Any, run_dir: Any) -> None:
        self._hook.forge_run_start(config=config, run_dir=run_dir)

    def step_end(self, step: int, metrics: Mapping[str, float], run_dir: Any) -> None:
        self._hook.forge_step_end(step=step, metrics=metrics, run_dir=run_dir)

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
) -> Registry:
    """Load plugins and collect their backends.

    ``plugins`` are extra plugins to register when embedding forgerl: import paths
    (``"pkg.module"``), which a run's processes load too, or objects (modules or
    instances), which exist in this process only. A plugin's name is its import path, or
    its ``forge_plugin_name``/``__name__``. ``disabled``/``strict``/``trace`` default to
    the environment switches.
    """
    disabled = set(disabled) if disabled is not None else _env_list("FORGE_DISABLE_PLUGINS")
    strict = _env_flag("FORGE_STRICT_PLUGINS") if strict is None else strict
    trace = _env_flag("FORGE_TRACE_HOOKS") if trace is None else trace

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if trace:
        pm.trace.root.setwriter(lambda s: sys.stderr.write(s))
        pm.enable_tracing()

    infos: dict[str, PluginInfo] = {}
    if entry_points:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "unknown"
            version = ep.dist.version if ep.dist else "?"
            info = PluginInfo(ep.name, dist, version)
            if ep.name in infos:
                prior = infos[ep.name]
                raise PluginError(
                    f"two plugins are named {ep.name!r}: from {prior.distribution} {prior.version} "
                    f"and {dist} {version}. Uninstall one."
                )
            infos[ep.name] = info
            if ep.name in disabled:
                info.status = "blocked"
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure of a plugin
                _broken(info, f"failed to load: {type(exc).__name__}: {exc}", strict, exc)
                continue
            pm.register(obj, name=ep.name)

    refs = [r for r in _env_list_ordered("FORGE_PLUGINS")]
    refs += [p for p in plugins if isinstance(p, str) and p not in refs]
    for ref in refs:
        info = infos[ref] = PluginInfo(ref, "<FORGE_PLUGINS>", "")
        if ref in disabled:
            info.status = "blocked"
            continue
        try:
            obj = importlib.import_module(ref)
        except Exception as exc:  # noqa: BLE001 - any import failure of a plugin
            # Named explicitly by the user: failing to load it is always an error.
            raise PluginLoadError(
                f"plugin {ref!r} failed to load: {type(exc).__name__}: {exc}; check the import path"
            ) from exc
        pm.register(obj, name=ref)
    objects = [p for p in plugins if not isinstance(p, str)]
    for obj in objects:
        name = getattr(obj, "forge_plugin_name", None) or getattr(obj, "__name__", None) or type(obj).__name__
        if name in disabled:
            infos[name] = PluginInfo(name, "<embedded>", "", status="blocked")
            continue
        infos[name] = PluginInfo(name, "<embedded>", "")
        pm.register(obj, name=name)

    _check_pending(pm, infos, strict)
    for name, info in infos.items():
        plugin = pm.get_plugin(name)
        if plugin is not None:
            info.hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
    return Registry(pm, infos, refs)


def _broken(info: PluginInfo, why: str, strict: bool, exc: BaseException | None = None) -> None:
    info.status = "broken"
    info.error = why
    message = f"plugin {info.name!r} ({info.distribution} {info.version}) {why}"
    if strict or info.first_party:
        # A broken built-in plugin is a bug in forgerl, not something to skip quietly.
        raise PluginError(message) from exc
    _warn(message + " (it is skipped; FORGE_STRICT_PLUGINS=1 makes this an error)")


def _check_pending(pm: pluggy.PluginManager, infos: dict[str, PluginInfo], strict: bool) -> None:
    """pluggy's check_pending, one offender at a time: a hook implementation whose name
    matches no spec (a typo) must fail loudly instead of silently never running."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin) or str(exc.plugin)
            info = infos.get(name) or PluginInfo(name, "<embedded>", "")
            pm.unregister(exc.plugin)
            _broken(info, f"has an unknown hook: {exc}", strict, exc)
