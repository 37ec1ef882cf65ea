"""Where a run's model comes from: a named model built into the cache, a Hugging Face
folder or hub id, or another run's checkpoint written once as a folder
(:func:`resolve_model`)."""

from __future__ import annotations

from forgerl.models.resolve import default_cache_dir, resolve_model

__all__ = ["default_cache_dir", "resolve_model"]
