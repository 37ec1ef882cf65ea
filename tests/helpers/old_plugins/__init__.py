"""Plugins written against earlier forgerl releases, kept as they were written.

Each is copied into a fake installed distribution (a dist-info folder on ``sys.path``) by
the tests of tests/unit/test_old_plugins.py, which check that the current core runs it
(with a deprecation warning naming the replacement) or refuses it in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: package -> (distribution, version, entry-point name, entry-point module)
PLUGINS = {"forgerl_files": ("forgerl-files", "0.1.0", "files", "forgerl_files.plugin")}


def install(package: str, site: Path) -> Path:
    """Put ``package`` into ``site`` as pip would have installed it: the package folder and
    a dist-info with its ``forgerl`` entry point. Returns ``site`` (put it on sys.path, or
    PYTHONPATH for a run's processes)."""
    dist, version, entry, module = PLUGINS[package]
    site.mkdir(parents=True, exist_ok=True)
    shutil.copytree(HERE / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[forgerl]\n{entry} = {module}\n")
    return site
