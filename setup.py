"""Two source roots: core/ holds the ``forgerl`` package and plugins/ holds
``forgerl_plugins``. Everything else is in pyproject.toml; this file exists because
setuptools' declarative config cannot name two roots.

An editable install (``pip install -e .``, what scripts/setup.sh does) puts both roots on
sys.path with one plain .pth file, instead of setuptools' default for such layouts, an
import-hook finder that type checkers, IDEs and import-graph tools cannot follow."""

from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {"forgerl": "core", "forgerl_plugins": "plugins"}

packages = []
package_dir = {}
for package, root in ROOTS.items():
    for found in find_packages(root, include=[package, f"{package}.*"]):
        packages.append(found)
    package_dir[package] = f"{root}/{package}"

commands = {}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # a setuptools without PEP 660 support: its own editable mode applies
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class _RootsOnPath:
        """An editable strategy (setuptools' EditableStrategy protocol): the wheel holds
        one .pth file whose lines are the source roots, so ``import forgerl`` is a plain
        path lookup that lands in core/forgerl."""

        def __init__(self, name, roots):
            self.name, self.roots = name, roots

        def __call__(self, wheel, files, mapping):
            lines = "".join(f"{root}\n" for root in self.roots)
            wheel.writestr(f"__editable__.{self.name}.pth", lines.encode())

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return False

    class EditableOnPath(editable_wheel):
        def _select_strategy(self, name, tag, build_lib):
            if str(self.mode or "").lower() == "strict":  # a link tree was asked for: keep it
                return super()._select_strategy(name, tag, build_lib)
            project = Path(self.project_dir).resolve()
            return _RootsOnPath(name, [project / root for root in ROOTS.values()])

    commands["editable_wheel"] = EditableOnPath

setup(packages=packages, package_dir=package_dir, cmdclass=commands)
