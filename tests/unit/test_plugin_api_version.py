"""The plugin API's version, and a plugin's requirement on it (``FORGERL_PLUGIN_API``).

A plugin that requires a plugin API this forgerl does not provide is not loaded: one line
names the plugin, what it requires and what is installed; a warning that skips it, or an
error (exit status 2) under ``FORGE_STRICT_PLUGINS=1`` or when the plugin was named
explicitly, as for any broken plugin. A requirement that is met changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.api_version import PLUGIN_API_VERSION, satisfies
from forgerl.errors import BrokenPlugin, UnknownBackend
from forgerl.registry.plugins import build_registry

from ..helpers.timing import scaled
from .fakedist import make_dist

PLUGIN = """
from forgerl.backends import TaskBackend
from forgerl.hookspecs import hookimpl

FORGERL_PLUGIN_API = {requirement}

@hookimpl
def forge_tasks():
    return [TaskBackend(name="versioned_task", factory="builtins:dict", description="a task")]
"""


def plugin(requirement: object) -> str:
    return PLUGIN.format(requirement=repr(requirement))


@pytest.mark.parametrize(
    ("requirement", "version", "met"),
    [
        (">=1.0,<2", "1.0", True),
        (">=1.0,<2", "1.7", True),
        (">=1.0,<2", "2.0", False),
        (">=1.1", "1.0", False),
        (">=1", "1.0", True),
        ("<1", "1.0", False),
        ("==1.0", "1.0", True),
        ("==1.*", "1.9", True),
        ("==1.*", "2.0", False),
        ("!=1.1", "1.1", False),
        ("~=1.2", "1.9", True),
        ("~=1.2", "1.1", False),
        ("~=1.2", "2.0", False),
        (" >= 1.0 , < 2 ", "1.0", True),
        (">=1.0,", "1.0", True),  # a trailing comma is harmless, as pip allows
    ],
)
def test_requirements_read_as_pip_reads_them(requirement: str, version: str, met: bool):
    assert satisfies(requirement, version) is met


@pytest.mark.parametrize("requirement", ["banana", "", "1.0", ">=x", "~=1", ">=1.*", "=>1.0", ">=1.0,<2,junk"])
def test_a_requirement_that_cannot_be_read_is_refused(requirement: str):
    with pytest.raises(ValueError):
        satisfies(requirement, "1.0")


def test_the_version_is_one_of_the_package():
    import forgerl

    assert forgerl.PLUGIN_API_VERSION == PLUGIN_API_VERSION
    assert satisfies(f"=={PLUGIN_API_VERSION}")


def test_a_plugin_whose_requirement_is_met_loads(site: Path, capsys: pytest.CaptureFixture[str]):
    make_dist(site, "fake-current", "1.0.0", {"current": plugin(">=1.0,<2")})
    registry = build_registry(strict=True)
    assert registry.plugins["current"].status == "loaded"
    assert "versioned_task" in registry.backends("task")
    assert capsys.readouterr().err == ""


def test_a_plugin_requiring_another_plugin_api_is_skipped_with_one_line(
    site: Path, capsys: pytest.CaptureFixture[str]
):
    """Not loaded (its backends absent, its other hooks never run), one warning line naming
    the plugin, what it requires and what this forgerl provides; the rest still works."""
    make_dist(site, "fake-future", "3.0.0", {"future": plugin(">=2.0,<3")})
    registry = build_registry()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("forge: warning: plugin 'future' (fake-future 3.0.0) requires the forgerl plugin API >=2.0,<3")
    assert f"provides {PLUGIN_API_VERSION}" in line and "FORGE_STRICT_PLUGINS=1" in line, line
    info = registry.plugins["future"]
    assert info.status == "broken" and "requires the forgerl plugin API >=2.0,<3" in (info.error or "")
    assert info.hooks == []
    with pytest.raises(UnknownBackend):
        registry.get("task", "versioned_task")
    assert "hf" in registry.backends("generator")


def test_under_strict_plugins_an_unmet_requirement_is_an_error(site: Path):
    make_dist(site, "fake-future", "3.0.0", {"future": plugin(">=2.0,<3")})
    with pytest.raises(BrokenPlugin) as refused:
        build_registry(strict=True)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("plugin 'future' (fake-future 3.0.0) requires the forgerl plugin API >=2.0,<3")
    assert refused.value.user_fixable


def test_a_plugin_named_explicitly_with_an_unmet_requirement_is_an_error(tmp_path: Path, monkeypatch):
    (tmp_path / "fake_explicit_future.py").write_text(plugin("<1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BrokenPlugin, match=r"plugin 'fake_explicit_future' .* requires the forgerl plugin API <1"):
        build_registry(plugins=["fake_explicit_future"], strict=False)
    sys.modules.pop("fake_explicit_future", None)


@pytest.mark.parametrize(("requirement", "why"), [("version two", "cannot be read"), (2, "not a version requirement")])
def test_a_requirement_that_cannot_be_read_skips_the_plugin_saying_so(
    site: Path, capsys: pytest.CaptureFixture[str], requirement: object, why: str
):
    make_dist(site, "fake-garbled", "1.0", {"garbled": plugin(requirement)})
    registry = build_registry()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"forge: warning: plugin 'garbled' (fake-garbled 1.0) states FORGERL_PLUGIN_API = {requirement!r}")
    assert why in line, line
    assert registry.plugins["garbled"].status == "broken"


def test_a_plugin_importing_a_name_forgerl_lacks_is_told_it_may_be_for_another_api(
    site: Path, capsys: pytest.CaptureFixture[str]
):
    make_dist(site, "fake-stale", "0.1", {"stale": "from forgerl.interfaces import GoneInterface\n"})
    build_registry()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "cannot import name 'GoneInterface' from 'forgerl.interfaces'" in line, line
    assert f"this one provides plugin API {PLUGIN_API_VERSION}" in line and "CHANGELOG.md" in line, line


def _forge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    for var in ("FORGE_DEBUG", "FORGE_DISABLE_PLUGINS", "FORGE_PLUGINS"):
        full.pop(var, None)
    return subprocess.run([sys.executable, "-m", "forgerl.cli", *args], capture_output=True, text=True,
                          env=full, timeout=scaled(60))


def test_forge_says_in_one_line_which_plugin_needs_another_api(tmp_path: Path):
    """At the command line: `forge plugins list` warns and lists the plugin as broken; under
    FORGE_STRICT_PLUGINS=1 it is one error line and exit status 2, no traceback."""
    site = make_dist(tmp_path / "site", "fake-future", "3.0.0", {"future": plugin(">=2.0,<3")})
    env = {"PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    listed = _forge("plugins", "list", env={**env, "FORGE_STRICT_PLUGINS": "0"})
    assert listed.returncode == 0, listed.stderr
    assert "requires the forgerl plugin API >=2.0,<3" in listed.stdout + listed.stderr
    strict = _forge("plugins", "list", env={**env, "FORGE_STRICT_PLUGINS": "1"})
    assert strict.returncode == 2, (strict.stdout, strict.stderr)
    lines = strict.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in strict.stderr, strict.stderr
    assert lines[0].startswith("forge: error: plugin 'future' (fake-future 3.0.0) requires the forgerl plugin API")


def test_forge_version_names_the_plugin_api():
    import forgerl

    done = _forge("--version", env={})
    assert done.stdout.strip() == f"forge {forgerl.__version__} (plugin API {PLUGIN_API_VERSION})"
