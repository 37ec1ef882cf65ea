"""The public path of the embedding API's registry (docs/embedding.md, docs/transports.md).

Kept for plugins and embedding code: the names live in :mod:`forgerl.registry.plugins`, which
forgerl itself imports.
"""

from forgerl.registry.plugins import Registry, build_registry

__all__ = ["Registry", "build_registry"]
