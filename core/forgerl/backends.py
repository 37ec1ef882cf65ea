"""Backend records: what the registry keeps of each backend selectable by name.

A plugin registers a backend as one class (:mod:`forgerl.registry.backend_classes`), from which the
registry makes its record; a record written by hand (the earlier shape) names a factory
and an options model, either as ``"module:attr"``, imported only when used.

Every record builds its backend with one method, ``build(options, **runtime)``, whose
keyword arguments are the runtime objects :data:`forgerl.contract.CONTRACT` gives for
its kind: it validates the options once into the options model and calls
``factory(options_model, **runtime)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from forgerl.contract import CONTRACT, check_factory
from forgerl.errors import BackendContractError, BackendLoadError

if TYPE_CHECKING:  # pragma: no cover
    from pydantic import BaseModel

    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec

#: What ``build`` takes as options: the validated model, or a mapping (a config's options
#: block) validated by ``build`` itself, or None for all defaults.
Options: TypeAlias = "BaseModel | Mapping[str, Any] | None"

# Listing backends (`forge --help`, `forge plugins list`) must stay fast: records may name
# their options model as "module:attr", imported only when options are validated, so that
# registration modules need not import pydantic at all.
NO_OPTIONS = "forgerl.options:NoOptions"


@dataclass(frozen=True)
class Backend:
    """Base record. ``kind`` is fixed per subclass ("generator", "trainer", ...)."""

    kind: ClassVar[str] = "backend"

    name: str
    factory: Callable[..., Any] | str | None
    #: The options model (a pydantic model with extra="forbid"), or "module:attr".
    options: type[BaseModel] | str = NO_OPTIONS
    description: str = ""
    #: Importable modules the backend needs at run time (checked without importing).
    requires: tuple[str, ...] = ()
    #: The pip extra of the distribution that installs ``requires``.
    extra: str | None = None
    #: The distribution whose extra it is (first-party backends: forgerl).
    extra_of: str = "forgerl"
    #: Overrides the pip-extra hint when installing is not a plain extra.
    install_hint: str | None = None
    #: False for a backend that is registered but whose implementation has not landed.
    implemented: bool = True
    #: Free-form facts for ``forge plugins list`` (e.g. how it is installed).
    info: dict[str, Any] = field(default_factory=dict)
    #: Optional cheap check run by ``forge run`` before anything is created or started:
    #: ``preflight(options)`` with the validated options raises a UserError for what the
    #: user must fix (a missing or unreadable data file). "module:attr" is imported only then.
    preflight: Callable[..., Any] | str | None = None
    #: Like ``preflight``, for what depends on the machine the processes run on (a library
    #: such as NCCL, a GPU, an environment variable): run only where the scheduler starts
    #: them on this machine (:attr:`forgerl.interfaces.Scheduler.runs_here`).
    local_preflight: Callable[..., Any] | str | None = None
    #: Set by the registry, not by plugins: "plugin NAME (DISTRIBUTION VERSION)", so that
    #: a failure to import the implementation says whose it is.
    provider: str = field(default="", compare=False)

    def unavailable_reason(self) -> str | None:
        """None when the backend can be used here, else one line saying why and what to do."""
        if not self.implemented:
            return "not implemented yet"
        missing = [m for m in self.requires if not _importable(m)]
        if missing:
            what = ", ".join(missing)
            if self.install_hint:
                return f"needs {what}: {self.install_hint}"
            if self.extra:
                return f"needs {what}: pip install '{self.extra_of}[{self.extra}]'"
            return f"needs {what}: pip install {missing[0]}"
        return None

    def load_factory(self) -> Callable[..., Any]:
        if self.factory is None:
            raise TypeError(f"{self.kind} {self.name!r} has no factory")
        return self.load_part(self.factory, "factory")

    def load_part(self, ref: Any, part: str) -> Any:
        """``ref`` itself, or the object a "module:attr" ref names. A module that fails to
        import (a missing dependency, a bug in the plugin) is a :class:`BackendLoadError`:
        one line naming the backend, its plugin and where the import failed."""
        if not isinstance(ref, str):
            return ref
        try:
            return _import(ref)
        except Exception as exc:
            raise BackendLoadError(self._load_failure(ref, part, exc)) from exc

    def _load_failure(self, ref: str, part: str, exc: Exception) -> str:
        # The cause first: schedulers show a failed run's last log line shortened.
        where = _failing_line(exc)
        message = (
            f"{self._label()} cannot be loaded: {type(exc).__name__}: {exc} "
            f"(importing its {part} {ref!r}{f', at {where}' if where else ''})"
        )
        return " ".join(message.split())

    @property
    def options_model(self) -> type[BaseModel]:
        """The options model, imported on first use when given as "module:attr"."""
        return self.load_part(self.options, "options model")

    def build(self, options: Options, **runtime: Any) -> Any:
        """``factory(validated options, **runtime)``: the one way every kind is built, with
        the keyword arguments :data:`forgerl.contract.CONTRACT` gives for this kind. The
        options are validated here once (a model of the right class passes as is); a
        factory that cannot take ``runtime`` is refused before it is called."""
        expected = CONTRACT[self.kind].keywords
        if set(runtime) != expected:
            raise TypeError(f"a {self.kind} is built with {sorted(expected)}, not {sorted(runtime)}")
        validated = self.validate_options(options)
        return self._built(self._call(self.factory, "factory", self.kind, validated, runtime), validated)

    def _built(self, product: Any, options: BaseModel) -> Any:
        """What was built with ``options``, checked or converted as its kind requires."""
        return product

    def server_roles(self, options: Options, *, context: RunContext) -> list[RoleSpec]:
        """The server roles this backend needs with ``options`` (none when it declares no
        ``roles``; only generators, rewards and teachers can)."""
        roles = getattr(self, "roles", None)
        if roles is None:
            return []
        validated = self.validate_options(options)
        return list(self._call(roles, "roles", f"{self.kind} roles", validated, {"context": context}))

    def serve_role(self, options: Options, *, context: RunContext, role: str, replica: int) -> int:
        """Run replica ``replica`` of this backend's server role ``role`` in this process
        (:mod:`forgerl.server_role`) until it ends; its exit status."""
        serve = getattr(self, "serve", None)
        if serve is None:
            raise BackendContractError(
                f"{self._label()} declares the server role {role!r} but no `serve` to run it: give the "
                "class a static method serve(options, *, context, role, replica) -> int"
            )
        validated = self.validate_options(options)
        runtime = {"context": context, "role": role, "replica": replica}
        return int(self._call(serve, "serve", f"{self.kind} serve", validated, runtime))

    def _call(self, ref: Any, part: str, what: str, options: BaseModel, runtime: Mapping[str, Any]) -> Any:
        if ref is None:
            raise TypeError(f"{self.kind} {self.name!r} has no {part}")
        target = self.load_part(ref, part)
        check_factory(what, self._label(), ref, target, runtime)
        return target(options, **runtime)

    def _label(self) -> str:
        return f"{self.kind} {self.name!r}" + (f" of {self.provider}" if self.provider else "")

    def check_before_run(self, options: Options, *, runs_here: bool = False) -> None:
        """Run the backend's :attr:`preflight` check (if it declares one) on ``options``, and
        its :attr:`local_preflight` too when the run's processes start on this machine."""
        checks = [(self.preflight, "preflight check")]
        if runs_here:
            checks.append((self.local_preflight, "local preflight check"))
        for ref, part in checks:
            if ref is not None:
                self.load_part(ref, part)(self.validate_options(options))

    def validate_options(self, options: Options) -> BaseModel:
        """``options`` as the backend's options model: a model of that class (a resolved
        config's) passes as it is; a mapping, or None for all defaults, is validated."""
        model = self.options_model
        if isinstance(options, model):
            return options
        return model.model_validate(options or {})


def lazy_options(package: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for a registration module whose options models live in
    ``<package>.options``: ``from pkg import XOptions`` keeps working, and listing
    backends still never imports pydantic."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f"{package}.options"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def _import(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def _failing_line(exc: BaseException) -> str | None:
    """"file:line" of the plugin code where an import failed, skipping the import
    machinery (and this module): the line a plugin author has to look at."""
    here = os.path.abspath(__file__)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith("<") and os.path.abspath(f.filename) != here
        and os.sep + os.path.join("importlib", "__init__.py") not in f.filename
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class GeneratorBackend(Backend):
    """A generator: built with the run's transport, through which it receives new weights
    (``transport.receiver(...)`` in this process, or ``transport.receiver_spec()`` handed
    to the engine's worker processes). ``roles`` (optional): server processes the scheduler
    starts beside the trainer (e.g. vLLM replicas); in-process generators have none.
    ``serve`` runs one replica of such a role, in the process the role's command
    (:func:`forgerl.rundirs.runs.server_role_command`) starts."""

    kind: ClassVar[str] = "generator"
    roles: Callable[..., Any] | str | None = None
    serve: Callable[..., Any] | str | None = None


@dataclass(frozen=True)
class TrainerBackend(Backend):
    """A trainer, built on every trainer rank."""

    kind: ClassVar[str] = "trainer"


@dataclass(frozen=True)
class RewardBackend(Backend):
    """A reward. ``roles`` and ``serve`` (optional), as for a generator: server processes for
    it (e.g. a vLLM server for a large reward model). Roles of the same name from several
    rewards must be identical, and are started once (two rewards may share a server)."""

    kind: ClassVar[str] = "reward"
    roles: Callable[..., Any] | str | None = None
    serve: Callable[..., Any] | str | None = None

    def _built(self, reward: Any, options: BaseModel) -> Any:
        from forgerl.interfaces import Reward

        if isinstance(reward, Reward) and not reward.implements_scoring():
            raise BackendContractError(
                f"{self._label()}: {type(reward).__name__} implements neither score nor ascore; "
                "a Reward must override one of them"
            )
        return reward


@dataclass(frozen=True)
class TransportBackend(Backend):
    """A transport; built with ``context=None`` outside a run (a receiver in a generator's
    worker process)."""

    kind: ClassVar[str] = "transport"

    def _built(self, transport: Any, options: BaseModel) -> Any:
        # What another process needs to build the same transport (Transport.describe).
        from forgerl.interfaces import describe_transport

        describe_transport(transport, self.name, options.model_dump(mode="json"))
        return transport


@dataclass(frozen=True)
class SchedulerBackend(Backend):
    kind: ClassVar[str] = "scheduler"


@dataclass(frozen=True)
class TaskBackend(Backend):
    kind: ClassVar[str] = "task"


@dataclass(frozen=True)
class ModelBackend(Backend):
    """A named model source: building it returns a local Hugging Face folder (building or
    converting it on first use)."""

    kind: ClassVar[str] = "model"

    def _built(self, folder: Any, options: BaseModel) -> Path:
        return Path(folder)


@dataclass(frozen=True)
class EnvironmentBackend(Backend):
    """An environment: built once per trajectory, on trainer rank 0, from the options
    validated when the config was resolved."""

    kind: ClassVar[str] = "environment"


@dataclass(frozen=True)
class TeacherBackend(Backend):
    """A teacher for on-policy distillation: built once, on trainer rank 0. ``roles`` and
    ``serve`` (optional), as for a reward: server processes for it (a vLLM server for the
    teacher model), restarted by the scheduler like any replica."""

    kind: ClassVar[str] = "teacher"
    roles: Callable[..., Any] | str | None = None
    serve: Callable[..., Any] | str | None = None


BACKEND_KINDS: dict[str, type[Backend]] = {
    cls.kind: cls
    for cls in (
        GeneratorBackend,
        TrainerBackend,
        RewardBackend,
        TransportBackend,
        SchedulerBackend,
        TaskBackend,
        ModelBackend,
        EnvironmentBackend,
        TeacherBackend,
    )
}
