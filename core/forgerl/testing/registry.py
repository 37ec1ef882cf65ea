"""How the kits find the backend under test: by name, through the public registry."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.backends import Backend
    from forgerl.registry.plugins import Registry


@functools.cache
def _registry(plugins: tuple[str, ...]) -> Registry:
    from forgerl.registry.plugins import ENTRY_POINT_GROUP, build_registry

    # A plugin named here and also installed (pip install -e of the plugin under test) is
    # loaded once, through its entry point.
    installed = {ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return build_registry(plugins=[p for p in plugins if p not in installed])


def registry_for(plugins: Sequence[str] = ()) -> Registry:
    """The registry of the installed plugins plus ``plugins`` (import paths of plugin
    modules not installed, e.g. the plugin of a checkout under test), built once."""
    return _registry(tuple(plugins))


def backend_under_test(kind: str, name: str, plugins: Sequence[str] = (), *, required: bool = False) -> Backend:
    """The registry's record of backend ``name`` of ``kind`` (made from its class, or
    registered by hand in the earlier shape). A backend that is registered but cannot
    be used here (a missing optional package) skips the test with the reason, or fails it
    when ``required``; an unknown name fails it, listing the known ones."""
    import pytest

    from forgerl.errors import BackendUnavailable, UnknownBackend

    registry = registry_for(plugins)
    try:
        return registry.require(kind, name)
    except UnknownBackend as exc:
        pytest.fail(f"{exc} (is the plugin installed, or named in the kit's `plugins`?)", pytrace=False)
    except BackendUnavailable as exc:
        if required:
            pytest.fail(f"{kind} {name!r} must be available here, but: {exc}", pytrace=False)
        pytest.skip(str(exc))
    raise AssertionError("unreachable")  # pragma: no cover
