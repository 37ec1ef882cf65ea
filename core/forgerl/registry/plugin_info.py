"""What is known about one plugin: where it came from, what it registered, whether it loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from forgerl.backends import Backend

FIRST_PARTY_DIST = "forgerl"
#: The "distribution" of plugins given by import path (FORGE_PLUGINS) or as objects.
EXPLICIT_REF = "<FORGE_PLUGINS>"
EXPLICIT_OBJECT = "<embedded>"


@dataclass
class PluginInfo:
    """What ``forge plugins list`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    status: str = "loaded"  # loaded | blocked | broken
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)

    @property
    def first_party(self) -> bool:
        return self.distribution == FIRST_PARTY_DIST

    @property
    def explicit(self) -> bool:
        """Named by the caller (an import path or an object), not found through an entry point."""
        return self.distribution in (EXPLICIT_REF, EXPLICIT_OBJECT)

    @property
    def label(self) -> str:
        """How messages name it: ``plugin 'echo' (fake-plugin 1.2.3)``."""
        return f"plugin {self.name!r} ({' '.join(p for p in (self.distribution, self.version) if p)})"
