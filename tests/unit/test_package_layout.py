"""The packages are plain folders on a plain sys.path entry (core/forgerl and
plugins/forgerl_plugins), so type checkers, IDEs and import-graph tools resolve
``import forgerl`` the way Python does. An import-hook finder (setuptools' default for an
editable install of a multi-root layout) would hide them from those tools."""

import importlib.machinery
import json
import subprocess
import sys

PROBE = """
import importlib.util, json, sys
import forgerl, forgerl_plugins
print(json.dumps({
    "files": [forgerl.__file__, forgerl_plugins.__file__],
    "loaders": [type(m.__spec__.loader).__name__ for m in (forgerl, forgerl_plugins)],
    "hooks": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
}))
"""


def probe() -> dict:
    # A fresh interpreter: what `python -c "import forgerl"` sees, not pytest's sys.path.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout)


def test_packages_are_found_by_a_plain_path_lookup_not_an_import_hook():
    seen = probe()
    assert seen["hooks"] == [], f"an import-hook finder maps the packages: {seen['hooks']}"
    assert seen["loaders"] == [importlib.machinery.SourceFileLoader.__name__] * 2


def test_each_package_is_a_folder_named_like_the_package():
    for file, package in zip(probe()["files"], ("forgerl", "forgerl_plugins")):
        parts = file.split("/")
        assert parts[-2:] == [package, "__init__.py"], file
