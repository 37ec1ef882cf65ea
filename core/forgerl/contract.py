"""The build contract: how forgerl calls the class (or factory) of each kind of backend.

forgerl calls a backend's class with its options, already validated into the backend's
options model (never a dict), followed by the runtime objects of its kind as keyword
arguments. The calls, kind by kind, are :data:`CONTRACT`, the one place they are written
(the records' ``build``, error messages and the table in docs/plugins.md come from it).
A transport's ``context`` is None when it is built outside a run (a receiver in a
generator's worker process, a benchmark): it then learns where the sender is from
:meth:`Transport.receiver_spec`.

Runtime objects are named arguments: nothing travels through an untyped dict. A factory
that does not accept these arguments (one written for an older forgerl, e.g.
``factory(options, ctx)``) is refused before it is called, with one line naming the
plugin, the backend and the call it must accept (:func:`check_factory`).

This module imports nothing heavy: registration modules import :mod:`forgerl.backends`,
which imports it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from forgerl.errors import BackendContractError


@dataclass(frozen=True)
class Call:
    """How forgerl calls one part of a backend: the validated options model first, then
    these keyword arguments (name, type as the docs write it), returning ``returns``."""

    callee: str
    runtime: tuple[tuple[str, str], ...]
    returns: str
    note: str = ""

    @property
    def signature(self) -> str:
        keywords = ", ".join(f"{name}: {kind}" for name, kind in self.runtime)
        return f"{self.callee}(options{', *, ' + keywords if keywords else ''}) -> {self.returns}"

    @property
    def keywords(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.runtime)


_CONTEXT = ("context", "RunContext")
_ROLES = Call("roles", (_CONTEXT,), "list[RoleSpec]", "server processes started beside the trainer")
_SERVE = Call(
    "serve", (_CONTEXT, ("role", "str"), ("replica", "int")), "int",
    "one replica of a role, in the process `python -m forgerl.server_role` starts; returns its exit status",
)  # fmt: skip

#: The build contract, the one place it is written: kind (or "<kind> roles", "<kind> serve") -> the call.
#: Error messages, the records' ``build`` and docs/plugins.md's table come from it.
CONTRACT: dict[str, Call] = {
    "generator": Call("factory", (_CONTEXT, ("transport", "Transport")), "Generator"),
    "trainer": Call("factory", (_CONTEXT,), "Trainer", "on every trainer rank"),
    "transport": Call("factory", (("context", "RunContext | None"),), "Transport", "context is None outside a run"),
    "task": Call("factory", (("seed", "int"),), "Task"),
    "reward": Call("factory", (), "Reward"),
    "scheduler": Call("factory", (), "Scheduler"),
    "model": Call("factory", (("cache_dir", "Path"),), "Path", "a local Hugging Face folder"),
    "environment": Call("factory", (), "Environment", "once per trajectory"),
    "teacher": Call("factory", (_CONTEXT,), "Teacher", "on trainer rank 0"),
    "generator roles": _ROLES,
    "reward roles": _ROLES,
    "teacher roles": _ROLES,
    "generator serve": _SERVE,
    "reward serve": _SERVE,
    "teacher serve": _SERVE,
}

#: The call each kind's factory must accept, as error messages and docs write it.
SIGNATURES: dict[str, str] = {what: call.signature for what, call in CONTRACT.items()}


def contract_table() -> str:
    """docs/plugins.md's table of the contract (a docs test checks the page holds it)."""
    rows = ["| kind | how forgerl calls it |", "|---|---|"]
    for what, call in CONTRACT.items():
        note = f" ({call.note})" if call.note else ""
        rows.append(f"| {what} | `{call.signature.replace('|', chr(92) + '|')}`{note} |")
    return "\n".join(rows)


def check_factory(
    what: str, label: str, ref: Any, factory: Callable[..., Any], runtime: Mapping[str, Any]
) -> None:
    """Raise :class:`BackendContractError` when ``factory`` cannot be called as
    ``factory(options, **runtime)``, the call :data:`SIGNATURES` gives for ``what`` (a kind,
    or "generator roles", "reward roles"). ``label`` names the backend and its plugin in the message; ``ref``
    is how the record names the factory. A factory whose signature Python cannot read (a
    builtin) is called as is."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, **runtime)
    except TypeError as exc:
        name = ref if isinstance(ref, str) else getattr(factory, "__qualname__", repr(factory))
        raise BackendContractError(
            f"{label}: {name}{signature} cannot be called as forgerl builds a {what}: "
            f"{SIGNATURES[what]} ({exc}); the plugin was written for another forgerl version: "
            "upgrade it, or see docs/plugins.md"
        ) from None


# ------------------------------------------------------------------ deprecated names

_LEGACY_PROTOCOLS: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """The per-kind Protocols forgerl 0.1.0 had (``TransportFactory``, ...), kept for one
    release with a warning: a plugin that imports one for its annotations still loads."""
    from forgerl.deprecation import DEPRECATED, warn_deprecated

    if f"forgerl.contract.{name}" not in DEPRECATED:
        raise AttributeError(f"module 'forgerl.contract' has no attribute {name!r}")
    warn_deprecated(f"forgerl.contract.{name}")
    if name not in _LEGACY_PROTOCOLS:

        class LegacyFactory(Protocol):
            def __call__(self, options: Any, /, **runtime: Any) -> Any: ...

        LegacyFactory.__name__ = LegacyFactory.__qualname__ = name
        _LEGACY_PROTOCOLS[name] = LegacyFactory
    return _LEGACY_PROTOCOLS[name]
