"""forgerl: reinforcement-learning post-training for language models.

The embedding API (see docs/embedding.md)::

    import forgerl

    registry = forgerl.build_registry()
    config = forgerl.load_config("run.yaml", sets=["loop.steps=3"], registry=registry)
    result = forgerl.run(config, registry=registry)          # local, in the foreground
    handle = forgerl.submit(config, registry=registry)       # any scheduler, returns a handle

Importing forgerl is cheap: nothing heavy (torch, transformers) is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

__all__ = [
    "PLUGIN_API_VERSION",
    "ForgeError",
    "Registry",
    "RunConfig",
    "__version__",
    "build_registry",
    "load_config",
    "run",
    "submit",
]

_LAZY = {
    # The plugin API's version, not the distribution's (forgerl.api_version, CHANGELOG.md).
    "PLUGIN_API_VERSION": ("forgerl.api_version", "PLUGIN_API_VERSION"),
    "build_registry": ("forgerl.registry.plugins", "build_registry"),
    "Registry": ("forgerl.registry.plugins", "Registry"),
    "RunConfig": ("forgerl.configuration.config", "RunConfig"),
    "load_config": ("forgerl.api", "load_config"),
    "run": ("forgerl.api", "run"),
    "submit": ("forgerl.api", "submit"),
    "ForgeError": ("forgerl.errors", "ForgeError"),
}

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.api import load_config, run, submit
    from forgerl.api_version import PLUGIN_API_VERSION
    from forgerl.configuration.config import RunConfig
    from forgerl.errors import ForgeError
    from forgerl.registry.plugins import Registry, build_registry


def __getattr__(name: str) -> Any:
    # Lazy so that `import forgerl` (and `forge --help`) stays fast.
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'forgerl' has no attribute {name!r}") from None
    import importlib

    return getattr(importlib.import_module(module_name), attr)
