"""A run's weights as another run's model: ``--model runs/NAME``.

``model.name`` may name a run instead of a model: its run directory (``runs/sft``), or
``run:NAME`` (the directory ``NAME``, else ``runs/NAME``), both meaning the run's newest
usable checkpoint, or one checkpoint folder (``runs/sft/checkpoints/step-000050``). Such a
checkpoint is written once as a plain Hugging Face folder into the model cache
(``$FORGE_CACHE_DIR/runs/``) by the trainer class of the run that saved it
(:meth:`forgerl.interfaces.Trainer.export_checkpoint`: its weights, a LoRA adapter merged
in, with the config and tokenizer of that run's own base model, which may itself be a
run), and every process of the new run loads that folder as it would any model folder.

``forge run`` records the checkpoint it starts from (:func:`pin`): the new run's
config.yaml names the checkpoint folder, so the run resumes from the same weights
whatever the named run does later. A checkpoint folder that was since pruned is still
found in the cache, where it was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forgerl.errors import ConfigError, NotSupported

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.registry.plugins import Registry

PREFIX = "run:"
#: Written last into an exported folder: it is complete, and from which checkpoint.
MARKER = "forgerl-run-model.json"
_STEP = re.compile(r"step-(\d+)")
#: Runs whose base model is being resolved (a run named as its own ancestor is refused).
_resolving: set[Path] = set()


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run: its run directory, its folder and its step."""

    run_dir: Path
    folder: Path
    step: int


def find(name: str) -> RunCheckpoint | None:
    """The checkpoint ``name`` refers to, or None when it names no run (a model, a model
    folder, a hub id). ConfigError for a run that has no usable checkpoint."""
    from forgerl.rundirs import runs

    if name.startswith(PREFIX):
        ref = name[len(PREFIX):]
        for candidate in (Path(ref).expanduser(), Path("runs") / ref):
            if _is_run(candidate):
                return _newest(candidate, name)
        raise ConfigError(
            f"model {name!r}: no run {ref!r} (neither {ref} nor runs/{ref} is a run directory with {runs.CONFIG_FILE})"
        )
    path = Path(name).expanduser()
    try:
        if _is_run(path) and not (path / "config.json").exists():
            return _newest(path, name)
        step = _STEP.fullmatch(path.name)
        if step and path.parent.name == "checkpoints" and _is_run(path.parent.parent):
            return RunCheckpoint(path.parent.parent.resolve(), path.resolve(), int(step.group(1)))
    except (OSError, ValueError):  # a name no path can be: not a run
        return None
    return None


def _is_run(path: Path) -> bool:
    from forgerl.rundirs import runs

    try:
        return (path / runs.CONFIG_FILE).is_file()
    except (OSError, ValueError):
        return False


def _newest(run_dir: Path, name: str) -> RunCheckpoint:
    from forgerl.checkpoints import checkpoint

    folder = checkpoint.latest(run_dir)  # CheckpointUnusable when it has some and none is usable
    if folder is None:
        raise ConfigError(
            f"model {name!r} is a run without a checkpoint yet (one is written every checkpoint.every steps and at "
            "the end); wait for one, or name a model"
        )
    return RunCheckpoint(run_dir.resolve(), folder.resolve(), int(folder.name.split("-")[1]))


def run_config(found: RunCheckpoint) -> RunConfig:
    """The config of the run that saved ``found``."""
    from forgerl.configuration.config import read_yaml, validate_config
    from forgerl.rundirs import runs

    path = found.run_dir / runs.CONFIG_FILE
    return validate_config(read_yaml(path), source=str(path))


def exporting_trainer(found: RunCheckpoint, config: RunConfig, registry: Registry) -> type:
    """The trainer class that saved ``found``, which must be able to export it."""
    backend = registry.require("trainer", config.trainer.name)
    trainer = backend.load_factory()
    if not (isinstance(trainer, type) and getattr(trainer, "exports_checkpoints", False)):
        raise NotSupported(
            f"model {str(found.run_dir)!r}: that run was trained with the {config.trainer.name} trainer, which cannot "
            "write its checkpoints as a model folder; export it with that trainer's own tools and give the folder"
        )
    return trainer


def pin(config: RunConfig) -> tuple[RunConfig, str | None]:
    """``config`` with a run named as its model replaced by the checkpoint folder it means
    now, and a line saying so (None: the model names no run, or one checkpoint already)."""
    found = find(config.model.name)
    if found is None or Path(config.model.name).expanduser().resolve() == found.folder:
        return config, None
    pinned = config.model_copy(deep=True)
    pinned.model.name = str(found.folder)
    return pinned, f"model {config.model.name}: the weights of its step {found.step} ({found.folder})"


def resolve(
    found: RunCheckpoint, registry: Registry, cache_dir: Path, resolve_model: Callable[..., Path]
) -> Path:
    """The Hugging Face folder of ``found``'s weights in the cache, written on first use
    (under a file lock: the run's processes resolve it at the same time). The run's own
    model (a model, or another run) is resolved with ``resolve_model`` (that of
    :mod:`forgerl.models.resolve`, which calls this)."""
    from filelock import FileLock

    config = run_config(found)
    trainer = exporting_trainer(found, config, registry)
    root = cache_dir / "runs"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{_safe(found.run_dir.name)}-step-{found.step:06d}-{_key(found.folder)}"
    manifest = _manifest_digest(found.folder)
    if _complete(target, manifest):
        return target
    if manifest is None:
        raise ConfigError(f"model {str(found.folder)!r}: that checkpoint no longer exists (nor its export in {root})")
    from forgerl.checkpoints import checkpoint

    checkpoint.load(found.folder)  # CheckpointUnusable (one line) for a damaged one
    if found.run_dir in _resolving:
        raise ConfigError(f"model {str(found.run_dir)!r}: runs that name each other as their model")
    _resolving.add(found.run_dir)
    try:
        base = resolve_model(config.model, registry, cache_dir)  # the run's own model: maybe a run too
    finally:
        _resolving.discard(found.run_dir)
    options = registry.require("trainer", config.trainer.name).validate_options(config.trainer.options)
    with FileLock(str(root / f".{target.name}.lock")):
        if _complete(target, manifest):  # another process wrote it meanwhile
            return target
        shutil.rmtree(target, ignore_errors=True)  # from a checkpoint of the same step since replaced
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            trainer.export_checkpoint(found.folder / checkpoint.TRAINER, tmp, options=options, model_path=base,  # type: ignore[attr-defined]
                                      dtype=config.model.dtype)  # fmt: skip
            record = {"run_dir": str(found.run_dir), "checkpoint": str(found.folder), "step": found.step,
                      "manifest_sha256": manifest, "base_model": str(base)}  # fmt: skip
            (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
            tmp.chmod(0o755)  # mkdtemp's 0700 would keep the run's other users out
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path, manifest: str | None) -> bool:
    """Whether ``folder`` holds a finished export of the checkpoint whose manifest hashes to
    ``manifest`` (None: the checkpoint is gone, any finished export of it will do)."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return manifest is None or record.get("manifest_sha256") == manifest


def _manifest_digest(folder: Path) -> str | None:
    from forgerl.checkpoints import checkpoint

    try:
        return hashlib.sha256((folder / checkpoint.MANIFEST).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"model {str(folder)!r}: cannot read its checkpoint ({exc.strerror or exc})") from None


def _key(folder: Path) -> str:
    return hashlib.sha256(str(folder).encode()).hexdigest()[:12]


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name)[:60] or "run"
