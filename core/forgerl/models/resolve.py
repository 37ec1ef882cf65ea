"""Turning ``model.name`` into a local Hugging Face folder.

A name is, in this order: a named model a plugin provides (``forge plugins list`` shows
them; built or converted once into the cache directory), another run (its run directory,
``run:NAME`` or one of its checkpoint folders: its weights, :mod:`forgerl.models.from_run`), an
existing local folder with a ``config.json``, or a hub id ``owner/name``, fetched with huggingface_hub where the network
allows (``HF_HUB_OFFLINE=1`` uses only what the hub cache already holds). A bare word that
is none of these is a typo, refused with the close named model, never asked of the hub.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from forgerl.errors import ConfigError
from forgerl.rundirs.writable import directory_problem

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import ModelConfig
    from forgerl.registry.plugins import Registry

#: Files a model folder needs; weights only as safetensors (pickled .bin files are neither
#: fetched nor loaded).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def default_cache_dir() -> Path:
    """Where named models are built: ``$FORGE_CACHE_DIR`` or ``~/.cache/forgerl/models``."""
    env = os.environ.get("FORGE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "forgerl" / "models"


def resolve_model(model_config: ModelConfig, registry: Registry, cache_dir: Path | None = None) -> Path:
    """The local folder of ``model_config.name`` (see the module docstring for the order)."""
    name = model_config.name
    if name in registry.backends("model"):
        backend = registry.require("model", name)  # BackendUnavailable names the install step
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        try:
            options = backend.validate_options(model_config.options)
        except ValidationError as exc:
            from forgerl.configuration.config import format_validation_error

            raise ConfigError(format_validation_error(exc, prefix="model.options")) from None
        return backend.build(options, cache_dir=cache)

    from forgerl.models import from_run as run_model

    found = run_model.find(name)
    if found is not None:  # another run's weights, written once as a folder in the cache
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return run_model.resolve(found, registry, cache, resolve_model)

    local = Path(name).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local.resolve()
        raise ConfigError(
            f"model {name!r} is a folder without config.json, not a Hugging Face model folder "
            "(it needs config.json, the weights as safetensors and the tokenizer files)"
        )
    if local.exists():
        raise ConfigError(f"model {name!r} is a file; give the Hugging Face folder that holds it")
    if _looks_like_path(name):
        raise ConfigError(f"model {name!r}: no such folder")
    check_hub_id(name, registry)
    return _from_hub(name)


def check_cache_dir() -> None:
    """Raise a one-line ConfigError when named models cannot be built in the cache directory.

    An explicit ``FORGE_CACHE_DIR`` must have an existing parent (a typo there should not
    quietly grow a new tree); the default one's missing parents are created as usual."""
    env = os.environ.get("FORGE_CACHE_DIR")
    path = default_cache_dir()
    problem = directory_problem(path, create_parents=not env)
    if problem:
        what = f"FORGE_CACHE_DIR={env!r}" if env else f"the model cache {str(path)!r}"
        raise ConfigError(
            f"{what} {problem}; named models are built there: point FORGE_CACHE_DIR at a writable directory"
        )


def check_hub_id(name: str, registry: Registry) -> None:
    """A name that is neither a named model nor a local folder goes to the hub only when it
    reads as a hub id ``owner/name``: a bare word is a mistyped named model (or one whose
    plugin is disabled), and asking the hub for it would only blame the hub, after launch."""
    if "/" in name:
        return
    named = sorted(registry.backends("model"))
    close = difflib.get_close_matches(name, named, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"no named model {name!r}; did you mean {close[0]!r}? (named models: {', '.join(named)})")
    blocked = sorted(p.name for p in registry.plugins.values() if p.status == "blocked")
    if blocked:
        raise ConfigError(
            f"no named model {name!r}: plugin(s) {', '.join(map(repr, blocked))} disabled by FORGE_DISABLE_PLUGINS "
            "may provide it; remove it from FORGE_DISABLE_PLUGINS, or give a local folder or a hub id owner/name"
        )
    raise ConfigError(
        f"no named model {name!r} (named models: {', '.join(named) or 'none'}; see `forge plugins list`) and "
        "no such folder; a Hugging Face hub model is given as owner/name"
    )


def _looks_like_path(name: str) -> bool:
    # A hub id is "name" or "owner/name"; anything else that does not exist is a mistyped path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _from_hub(name: str) -> Path:
    named = "`forge plugins list`"
    prefix = (
        f"model {name!r} is not a named model (see {named}), not a local folder with config.json, "
        "and could not be fetched from the hub"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"{prefix}: huggingface_hub is not installed (pip install huggingface_hub)"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = Path(snapshot_download(repo_id=name, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except Exception as exc:  # noqa: BLE001 - network, auth, validation: all one user-facing line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if offline and "LocalEntryNotFound" in type(exc).__name__:
            reason += " (HF_HUB_OFFLINE is set: only models already in the hub cache can be used)"
        raise ConfigError(f"{prefix}: {type(exc).__name__}: {reason}") from None
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{prefix}: the hub repository has no config.json")
    return folder
