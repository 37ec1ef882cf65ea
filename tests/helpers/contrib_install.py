"""pip-install a contrib package as a user installs a plugin, without touching the checkout.

pip builds a local folder in place: setuptools writes ``build/`` and ``src/*.egg-info``
into it. An egg-info beside the package's source is plugin metadata that
``importlib.metadata`` finds on ``sys.path``, and the contrib tests put ``contrib/*/src``
on it: every later test of the same session would then see the contrib plugin
registered. So the package is copied first, and pip builds the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .timing import scaled

#: What a build leaves (or an earlier one left) in a package folder: never copied.
BUILD_LEFTOVERS = ("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def pip_install_copy(package: Path, workdir: Path) -> dict[str, str]:
    """Install a copy of ``package`` (no dependencies) into ``workdir/site``; return an
    environment whose PYTHONPATH puts that folder first. Fails if ``package`` changed."""
    before = _files(package)
    source = workdir / "source" / package.name
    shutil.copytree(package, source, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    target = workdir / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    added = sorted(_files(package) - before)
    assert not added, f"installing {package.name} wrote into the checkout: {added[:5]}"
    return {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
