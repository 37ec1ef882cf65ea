"""Every forgerl import path the docs give plugin authors and embedders works.

The docs (docs/*.md and README.md) are where a plugin author or an embedder learns which
names to import; a module moved inside forgerl must leave those paths working. Each
``from forgerl... import ...`` and ``import forgerl...`` written in them is imported here,
each dotted name they quote (```forgerl.runs.server_role_command```) is resolved, and each
``python -m forgerl...`` they show names a module that exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]

_FROM = re.compile(r"^\s*from (forgerl(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)", re.M)
_IMPORT = re.compile(r"^\s*import (forgerl(?:\.\w+)*)(?: as \w+)?\s*$", re.M)
# A dotted name quoted on its own or as a call: `forgerl.api.plan` or `forgerl.api.plan(config, ...)`.
_QUOTED = re.compile(r"`(forgerl(?:\.[A-Za-z_]\w*)+)(?:`|\()")
_MODULE_RUN = re.compile(r"-m (forgerl(?:\.\w+)+)")
# Quoted names that are not Python names: what they are instead.
NOT_PYTHON = {
    "forgerl.run_dir": "the MLflow tag a run is found by (docs/observability.md)",
    "forgerl.environment.verifiers": "a logger's name (docs/environments.md)",
}


def _names(clause: str) -> list[str]:
    clause = clause.strip().strip("()")
    return [item.split(" as ")[0].strip() for item in clause.replace("\n", " ").split(",") if item.strip()]


def documented() -> tuple[set[tuple[str, str]], set[str], set[str], set[str]]:
    """(module, name) pairs of from-imports, imported modules, quoted dotted names, ``-m`` modules."""
    pairs: set[tuple[str, str]] = set()
    modules: set[str] = set()
    quoted: set[str] = set()
    runs: set[str] = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, clause in _FROM.findall(text):
            pairs |= {(module, name) for name in _names(clause)}
        modules |= set(_IMPORT.findall(text))
        quoted |= set(_QUOTED.findall(text)) - set(NOT_PYTHON)
        runs |= set(_MODULE_RUN.findall(text))
    return pairs, modules, quoted, runs


def resolve(dotted: str) -> object:
    """The module or attribute a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(dotted)


PAIRS, MODULES, QUOTED, RUNS = documented()


def test_the_docs_name_the_paths_plugin_authors_use():
    # The scan itself works: these are in the plugin and embedding guides today.
    assert ("forgerl.hookspecs", "hookimpl") in PAIRS
    assert ("forgerl.plugins", "build_registry") in PAIRS
    assert "forgerl" in MODULES
    assert "forgerl.server_role" in RUNS


@pytest.mark.parametrize(("module", "name"), sorted(PAIRS), ids=lambda v: str(v))
def test_documented_from_import_works(module: str, name: str):
    # As Python reads it: a name of the module, else a submodule of that name.
    imported = importlib.import_module(module)
    if name != "*" and not hasattr(imported, name):
        try:
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            pytest.fail(f"the docs say `from {module} import {name}`: {module} has no {name}")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_documented_import_works(module: str):
    importlib.import_module(module)


@pytest.mark.parametrize("dotted", sorted(QUOTED))
def test_documented_dotted_name_resolves(dotted: str):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"the docs quote `{dotted}`, which does not resolve: {exc!r}")


@pytest.mark.parametrize("module", sorted(RUNS))
def test_documented_process_entry_point_exists(module: str):
    assert importlib.util.find_spec(module) is not None, f"the docs run `python -m {module}`: no such module"


def test_the_check_fails_on_a_path_that_moved():
    with pytest.raises((ImportError, AttributeError)):
        resolve("forgerl.no_such_module.thing")
    with pytest.raises(AttributeError):
        resolve("forgerl.errors.NoSuchError")
    assert _names("(\n    Environment,\n    Step as S,\n)") == ["Environment", "Step"]
