"""The build contract: how forgerl calls the factory of each kind of backend.

A backend record (:mod:`forgerl.backends`) names a factory: a class or a function. forgerl
calls it with the backend's options, already validated into the backend's options model
(never a dict), followed by the runtime objects of its kind as keyword arguments:

==========  ====================================================================
kind        factory call
==========  ====================================================================
generator   ``factory(options, *, context: RunContext, transport: Transport) -> Generator``
trainer     ``factory(options, *, context: RunContext) -> Trainer`` (on every rank)
transport   ``factory(options, *, context: RunContext | None) -> Transport``
task        ``factory(options, *, seed: int) -> Task``
reward      ``factory(options) -> Reward``
scheduler   ``factory(options) -> Scheduler``
model       ``factory(options, *, cache_dir: Path) -> Path``
==========  ====================================================================

A generator's or a reward's optional ``roles`` callable is called as
``roles(options, *, context: RunContext) -> list[RoleSpec]``. A transport's ``context``
is None when it is built outside a run (a receiver in a generator's worker process, a
benchmark): it then learns where the sender is from :meth:`Transport.receiver_spec`.

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
from typing import TYPE_CHECKING, Any, Protocol

from forgerl.errors import BackendContractError

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from forgerl.interfaces import Generator, Reward, RunContext, Scheduler, Task, Trainer, Transport
    from forgerl.types import RoleSpec


class GeneratorFactory(Protocol):
    def __call__(self, options: Any, /, *, context: RunContext, transport: Transport) -> Generator: ...


class GeneratorRoles(Protocol):
    def __call__(self, options: Any, /, *, context: RunContext) -> list[RoleSpec]: ...


class TrainerFactory(Protocol):
    def __call__(self, options: Any, /, *, context: RunContext) -> Trainer: ...


class TransportFactory(Protocol):
    def __call__(self, options: Any, /, *, context: RunContext | None) -> Transport: ...


class TaskFactory(Protocol):
    def __call__(self, options: Any, /, *, seed: int) -> Task: ...


class RewardFactory(Protocol):
    def __call__(self, options: Any, /) -> Reward: ...


class SchedulerFactory(Protocol):
    def __call__(self, options: Any, /) -> Scheduler: ...


class ModelFactory(Protocol):
    def __call__(self, options: Any, /, *, cache_dir: Path) -> Path: ...


#: The call each kind's factory must accept, as error messages and docs write it.
SIGNATURES: dict[str, str] = {
    "generator": "factory(options, *, context: RunContext, transport: Transport) -> Generator",
    "generator roles": "roles(options, *, context: RunContext) -> list[RoleSpec]",
    "reward roles": "roles(options, *, context: RunContext) -> list[RoleSpec]",
    "trainer": "factory(options, *, context: RunContext) -> Trainer",
    "transport": "factory(options, *, context: RunContext | None) -> Transport",
    "task": "factory(options, *, seed: int) -> Task",
    "reward": "factory(options) -> Reward",
    "scheduler": "factory(options) -> Scheduler",
    "model": "factory(options, *, cache_dir: Path) -> Path",
}


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
