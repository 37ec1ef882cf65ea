"""Registration modules (what a ``forgerl`` entry point names) stay light: importing one
imports none of pydantic, torch, transformers or numpy, so that ``forge --help`` and
``forge plugins list`` stay fast. Checked for forgerl's own plugins (pyproject.toml) and
for every package under contrib/ (its own pyproject.toml; imported from its src/ folder)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.timing import scaled

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("pydantic", "torch", "transformers", "numpy")


def entry_point_modules(pyproject: Path) -> list[str]:
    """The modules of the ``[project.entry-points.forgerl]`` table (read without tomllib,
    which Python 3.10 lacks: the table is ``name = "module"`` lines)."""
    table = re.search(r"^\[project\.entry-points\.forgerl\]\n(.*?)(?=^\[|\Z)", pyproject.read_text(), re.M | re.S)
    assert table is not None, f"{pyproject} has no [project.entry-points.forgerl] table"
    return sorted(re.findall(r'^\s*[\w.-]+\s*=\s*"([\w.]+)"', table.group(1), re.M))


# Imports the modules one by one and stops at the first that brings in a heavy module, so
# that the module named is the one that did it (later ones would find it imported already).
PROBE = """
import importlib, json, sys
sys.path[:0] = {paths!r}
heavy = {heavy!r}
for module in {modules!r}:
    importlib.import_module(module)
    found = [m for m in heavy if m in sys.modules]
    if found:
        print(json.dumps({{"module": module, "heavy": found}}))
        break
else:
    print(json.dumps(None))
"""


def first_heavy_import(modules: list[str], paths: list[str]) -> dict | None:
    code = PROBE.format(paths=paths, heavy=list(HEAVY), modules=modules)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_builtin_registration_modules_import_nothing_heavy():
    modules = entry_point_modules(REPO / "pyproject.toml")
    assert "forgerl_plugins.rewards" in modules, modules
    assert first_heavy_import(modules, []) is None


def test_contrib_registration_modules_import_nothing_heavy():
    projects = sorted(REPO.glob("contrib/*/pyproject.toml"))
    assert any(p.parent.name == "countdown" for p in projects), projects
    for project in projects:
        modules = entry_point_modules(project)
        found = first_heavy_import(modules, [str(project.parent / "src")])
        assert found is None, f"{project.parent.name}: importing {found['module']} imported {found['heavy']}"
