"""What a plugin touches cannot change unnoticed.

The plugin API's surface (tests/helpers/api_surface.py: the documented modules' names, the
members and parameters of their classes, RunContext's fields, the hooks and the build
contract) is compared with the snapshot stored beside this test. A change fails here until
whoever made it bumps the plugin API's version, writes CHANGELOG.md and rewrites the
snapshot (the command is in the failure message); the rewrite itself refuses a removal
that neither the version nor CHANGELOG.md accounts for.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import tomllib

import forgerl
from forgerl.api_version import PLUGIN_API_VERSION
from forgerl.deprecation import DEPRECATED, REMOVED, ForgeDeprecationWarning

from ..helpers import api_surface

REPO = Path(__file__).resolve().parents[2]
REWRITE = "PYTHONPATH=core:plugins .venv/bin/python -m tests.helpers.api_surface --write"


def test_the_plugin_api_surface_matches_its_snapshot():
    stored = api_surface.load_snapshot()
    difference = api_surface.compare(stored["surface"], api_surface.surface())
    assert not difference, (
        "the plugin API changed:\n" + "\n".join(difference.lines()) + "\n"
        "Plugins depend on these names. If the change is meant: keep a removed or renamed name "
        "working for one release (forgerl.deprecation), bump PLUGIN_API_VERSION in "
        "core/forgerl/api_version.py (MINOR for an addition, MAJOR for a removal or change), "
        "say what changed and how to migrate in CHANGELOG.md, then rewrite the snapshot: " + REWRITE
    )


def test_the_snapshot_is_of_this_plugin_api_version():
    assert api_surface.load_snapshot()["plugin_api"] == PLUGIN_API_VERSION, (
        f"PLUGIN_API_VERSION is {PLUGIN_API_VERSION}: rewrite the snapshot ({REWRITE})"
    )


def test_changelog_describes_this_release_and_plugin_api():
    """CHANGELOG.md's newest release is this distribution's version and names the plugin API
    it provides; pyproject.toml and forgerl.__version__ agree."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version == forgerl.__version__, "pyproject.toml's version and forgerl.__version__ differ"
    changelog = (REPO / "CHANGELOG.md").read_text()
    newest = re.search(r"(?m)^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", changelog)
    assert newest is not None, "CHANGELOG.md has no release heading '## [X.Y.Z] - YYYY-MM-DD'"
    assert newest.group(1) == forgerl.__version__, (
        f"CHANGELOG.md's newest release is {newest.group(1)}, forgerl is {forgerl.__version__}"
    )
    assert f"Plugin API {PLUGIN_API_VERSION}" in api_surface.newest_release(changelog), (
        f"CHANGELOG.md's {forgerl.__version__} does not name the plugin API it provides ({PLUGIN_API_VERSION})"
    )


@pytest.mark.parametrize("name", [*DEPRECATED, *REMOVED])
def test_every_deprecated_or_removed_name_is_in_the_changelog(name: str):
    """The release that deprecated or removed a name says so and how to migrate; later
    releases need not repeat it (the name warns, or fails, naming CHANGELOG.md)."""
    changelog = (REPO / "CHANGELOG.md").read_text()
    released = changelog[changelog.index("\n## [", changelog.index("## [Unreleased]") + 1):]
    short = name.removeprefix("forgerl.contract.")
    assert f"`{short}`" in released or f"`{name}`" in released, f"no CHANGELOG.md release names {name}"


@pytest.mark.parametrize("name", [n for n in DEPRECATED if n.startswith("forgerl.contract.")])
def test_every_deprecated_module_name_still_imports_with_a_warning(name: str):
    import importlib

    module_name, _, attr = name.rpartition(".")
    module = importlib.import_module(module_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(module, attr) is not None
    assert any(issubclass(w.category, ForgeDeprecationWarning) and name in str(w.message) for w in caught)


# ------------------------------------------------------------------ the comparison itself


def _surface_with_run_context_field(name: str) -> dict:
    surface = api_surface.surface()
    surface["modules"]["forgerl.interfaces"]["RunContext"]["members"][name] = "field="
    return surface


def test_a_removed_name_is_reported_and_must_be_in_the_changelog_and_a_major_bump():
    """A name present in the snapshot and gone now is a removal: reported, a MAJOR change,
    and unaccounted for until CHANGELOG.md's newest release names it."""
    stored = _surface_with_run_context_field("vanished")
    difference = api_surface.compare(stored, api_surface.surface())
    assert list(difference.removed) == ["forgerl.interfaces.RunContext.vanished"]
    assert not difference.added and not difference.changed
    assert "removed  forgerl.interfaces.RunContext.vanished" in "\n".join(difference.lines())
    assert api_surface.required_bump(difference) == "MAJOR"
    assert not api_surface.bumped("1.0", "1.1", "MAJOR") and api_surface.bumped("1.0", "2.0", "MAJOR")
    silent = "# Changelog\n\n## [9.9.9] - 2030-01-01\n\n### Added\n- something else\n"
    assert api_surface.unaccounted(difference, silent) == ["forgerl.interfaces.RunContext.vanished"]
    told = silent + "\n### Removed\n- `RunContext.vanished`: read `context.seed`.\n"
    assert api_surface.unaccounted(difference, told) == []


def test_an_added_name_is_a_minor_change():
    difference = api_surface.compare(api_surface.surface(), _surface_with_run_context_field("new_fact"))
    assert list(difference.added) == ["forgerl.interfaces.RunContext.new_fact"]
    assert api_surface.required_bump(difference) == "MINOR"
    assert api_surface.bumped("1.0", "1.1", "MINOR")


def test_a_changed_signature_is_reported_as_a_change():
    current = api_surface.surface()
    stored = api_surface.surface()
    stored["hooks"]["forge_step_end"] = "(step, metrics)"
    difference = api_surface.compare(stored, current)
    assert list(difference.changed) == ["hook forge_step_end"]
    assert api_surface.required_bump(difference) == "MAJOR"
