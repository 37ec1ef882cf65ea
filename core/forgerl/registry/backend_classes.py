"""One backend, one class: a backend's identity, options and implementation in one place.

A registration hook returns backend classes, or ``"module:Class"`` strings naming them
(imported when the registry collects its backends; a backend module imports nothing
heavy at its top level, so this stays fast; ``forge plugins list`` reads the identities
of unchanged classes from an index instead, :mod:`forgerl.registry.backend_index`). The class says
everything about the backend::

    class BrevityReward(Reward):
        name = "brevity"                          # --reward brevity
        description = "shorter completions score higher"
        requires = ()                             # importable modules it needs (checked, not imported)

        class Options(OptionsModel):              # validated once, when the config is resolved
            limit: int = Field(200, ge=1)

        def __init__(self, options: Options):     # the build contract of its kind (forgerl.contract)
            ...

Optional class attributes: ``extra`` (the pip extra that installs ``requires``),
``extra_of`` (its distribution, default forgerl), ``install_hint`` (instead of the
extra), ``implemented`` (False: registered, not built yet), ``info`` (facts for ``forge
plugins list``), and, as static methods taking the validated options, ``preflight`` and
``local_preflight`` (checks before launch) and, for generators, rewards and teachers, ``roles``
(server processes to start) and ``serve`` (what each of them runs). The registry keeps a
record of each class (:class:`forgerl.backends.Backend`): records written by hand are the earlier shape, still
accepted (docs/plugins.md, "Registering a backend").
"""

from __future__ import annotations

import importlib
from typing import Any

from forgerl.backends import NO_OPTIONS, Backend
from forgerl.errors import PluginError

#: Class attributes copied into the record as they are, with their defaults.
_PLAIN = {
    "description": "",
    "requires": (),
    "extra": None,
    "extra_of": "forgerl",
    "install_hint": None,
    "implemented": True,
    "info": None,
    "preflight": None,
    "local_preflight": None,
}


def record_for_class(expected: type[Backend], given: Any, hook: str) -> Backend:
    """The record of backend class ``given`` (a class, or "module:Class") for a hook that
    registers backends of ``expected``'s kind."""
    cls = _load(given, hook) if isinstance(given, str) else given
    interface = _interfaces().get(expected.kind)
    if interface is not None and not issubclass(cls, interface):
        article = "an" if interface.__name__[0] in "AEIOU" else "a"
        kind_article = "an" if expected.kind[0] in "aeiou" else "a"
        raise PluginError(
            f"{hook} returned the class {cls.__qualname__}, which is not {article} {interface.__name__}: "
            f"{kind_article} {expected.kind} backend subclasses {interface.__module__}.{interface.__name__}"
        )
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise PluginError(
            f"{hook} returned the class {cls.__qualname__}, which has no `name` of its own: "
            'give it a class attribute `name = "..."`, the name users select it by'
        )
    fields: dict[str, Any] = {key: getattr(cls, key, default) for key, default in _PLAIN.items()}
    fields["requires"] = tuple(fields["requires"])
    fields["info"] = dict(fields["info"] or {})
    if not fields["description"]:
        fields["description"] = (cls.__doc__ or "").strip().split("\n")[0].rstrip(".")
    for server_part in ("roles", "serve"):
        if server_part in expected.__dataclass_fields__:
            fields[server_part] = getattr(cls, server_part, None)
    return expected(name=name, factory=cls, options=getattr(cls, "Options", NO_OPTIONS), **fields)


def _interfaces() -> dict[str, type]:
    """Kind -> the interface its backend classes implement (a model backend has none: it is
    a class or function that returns a folder)."""
    from forgerl import interfaces
    from forgerl.environment import Environment
    from forgerl.teacher import Teacher

    return {
        "environment": Environment,
        "teacher": Teacher,
        "generator": interfaces.Generator,
        "trainer": interfaces.Trainer,
        "reward": interfaces.Reward,
        "transport": interfaces.Transport,
        "scheduler": interfaces.Scheduler,
        "task": interfaces.Task,
    }


def _load(ref: str, hook: str) -> type:
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # the plugin's module failed to import: say whose and where
        raise PluginError(
            f"{hook} names {ref!r}, which cannot be imported: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, type):
        raise PluginError(f"{hook} names {ref!r}, which is a {type(obj).__name__}, not a class")
    return obj
