"""The base of the built-in named models: building one gives its local folder, path-like.

A model backend's class is called as forgerl calls any model factory,
``Model(options, *, cache_dir=...)``, and the registry takes ``Path(...)`` of what it
returns (:class:`forgerl.backends.ModelBackend`). Making the instance path-like lets the
class carry the model's name, options and builder (one backend, one class) while the
contract stays the one third-party factories meet: a function returning a ``Path`` works
as before.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelFolder(os.PathLike[str]):
    """A model's folder, built (or found built) when the instance is made."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"
