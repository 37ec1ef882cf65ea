"""Backend records: what a plugin's hooks return to make a backend selectable by name.

A record names a backend, carries its options model (pydantic, ``extra="forbid"``) and a
factory. The factory may be given as ``"module:attr"`` so that listing backends never
imports a heavy dependency: the module is imported only when the backend is built.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict


class NoOptions(BaseModel):
    """Options model of a backend that takes none."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Backend:
    """Base record. ``kind`` is fixed per subclass ("generator", "trainer", ...)."""

    kind: ClassVar[str] = "backend"

    name: str
    factory: Callable[..., Any] | str | None
    options: type[BaseModel] = NoOptions
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
        if callable(self.factory):
            return self.factory
        module_name, _, attr = self.factory.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
        return obj

    def create(self, options: BaseModel | dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Validate ``options`` and build the backend: ``factory(options, *args, **kwargs)``."""
        return self.load_factory()(self.validate_options(options), *args, **kwargs)

    def validate_options(self, options: BaseModel | dict[str, Any] | None) -> BaseModel:
        if isinstance(options, self.options):
            return options
        return self.options.model_validate(options or {})


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class GeneratorBackend(Backend):
    """``factory(options, ctx: RunContext) -> Generator``.

    ``roles`` (optional) is ``roles(options, ctx) -> list[RoleSpec]``: server processes
    the scheduler must start beside the trainer (e.g. vLLM replicas). In-process
    generators have none.
    """

    kind: ClassVar[str] = "generator"
    roles: Callable[..., Any] | str | None = None


@dataclass(frozen=True)
class TrainerBackend(Backend):
    """``factory(options, ctx: RunContext) -> Trainer`` (called on every trainer rank)."""

    kind: ClassVar[str] = "trainer"


@dataclass(frozen=True)
class RewardBackend(Backend):
    """``factory(options) -> Reward``."""

    kind: ClassVar[str] = "reward"


@dataclass(frozen=True)
class TransportBackend(Backend):
    """``factory(options, ctx: RunContext | None) -> Transport``."""

    kind: ClassVar[str] = "transport"


@dataclass(frozen=True)
class SchedulerBackend(Backend):
    """``factory(options) -> Scheduler``."""

    kind: ClassVar[str] = "scheduler"


@dataclass(frozen=True)
class TaskBackend(Backend):
    """``factory(options, seed: int) -> Task``."""

    kind: ClassVar[str] = "task"


@dataclass(frozen=True)
class ModelBackend(Backend):
    """A named model source: ``factory(options, cache_dir: Path) -> Path`` returns a local
    Hugging Face folder (building or converting it on first use)."""

    kind: ClassVar[str] = "model"


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
    )
}
