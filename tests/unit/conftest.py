"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path where fake distributions are 'installed' (``make_dist``),
    with the plugin switches unset; their modules are forgotten afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    for var in ("FORGE_DISABLE_PLUGINS", "FORGE_STRICT_PLUGINS", "FORGE_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    yield root
    for name in list(sys.modules):
        if name.startswith(("fake_", "other_")):
            del sys.modules[name]
