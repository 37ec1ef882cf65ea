"""The modules of the core and of the first-party plugins import each other without cycles,
at run time and for type checking; the core's sub-packages form layers; the core imports no
plugin.

A cycle, even one only under ``if TYPE_CHECKING:``, means two modules are one idea that
cannot be understood or changed alone (as when ``RunContext`` carried the whole run
config), and inside a backend package it means a part imports the class that assembles it.
The graph is read from the source with ``ast``: an edge for every import of a module of the
tree, at the top, inside a function or under ``TYPE_CHECKING``, relative ones included;
``from forgerl import x`` is an edge to ``forgerl.x`` when ``x`` is a module.

The core's package graph has a node per sub-package (``forgerl.rollouts``, ...) and per
top-level module (``forgerl.interfaces``, ...): an import from one into another is an edge
between them. No cycles there means each sub-package can be read knowing only what lies
below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core"
PLUGINS = REPO / "plugins"


def modules_of(root: Path, package: str) -> dict[str, Path]:
    modules = {}
    for path in (root / package).rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def core_modules() -> dict[str, Path]:
    return modules_of(CORE, "forgerl")


def plugin_modules() -> dict[str, Path]:
    return modules_of(PLUGINS, "forgerl_plugins")


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str | None:
    """The absolute module a ``from`` import names (relative ones resolved against ``module``)."""
    if node.level == 0:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def imports_of(path: Path, modules: dict[str, Path], module: str | None = None) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module or "", path) if node.level else node.module
            if not source:
                continue
            submodules = {f"{source}.{alias.name}" for alias in node.names} & set(modules)
            found |= submodules if len(submodules) == len(node.names) else {source, *submodules}
    return found & set(modules)


def all_imports(path: Path) -> set[str]:
    """Every absolute module name a file imports (its first component is enough to tell a package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def graph_of(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imports_of(path, modules, name) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The node of ``module`` in the package graph: its sub-package of ``forgerl``, or itself
    when it is a top-level module (or ``forgerl`` itself)."""
    parts = module.split(".")
    if len(parts) >= 2 and f"{parts[0]}.{parts[1]}" in modules and modules[f"{parts[0]}.{parts[1]}"].name == "__init__.py":
        return f"{parts[0]}.{parts[1]}"
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        node = package_of(module, modules)
        packages.setdefault(node, set())
        for other in imported:
            target = package_of(other, modules)
            packages.setdefault(target, set())
            if target != node:
                packages[node].add(target)
    return packages


def _detail(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "; ".join(" ".join(f"{m} -> {sorted(graph[m] & set(group))}" for m in group) for group in found)


def test_core_has_no_import_cycles():
    graph = graph_of(core_modules())
    found = cycles(graph)
    assert not found, f"import cycles in core: {_detail(graph, found)}"


def test_plugins_have_no_import_cycles():
    """Inside a backend package, the parts never import the class that assembles them."""
    graph = graph_of(plugin_modules())
    found = cycles(graph)
    assert not found, f"import cycles in plugins/forgerl_plugins: {_detail(graph, found)}"


def test_core_sub_packages_form_layers():
    modules = core_modules()
    packages = package_graph(graph_of(modules), modules)
    assert {"forgerl.registry", "forgerl.runloop", "forgerl.interfaces"} <= set(packages)
    found = cycles(packages)
    assert not found, f"core sub-packages import each other in a cycle: {_detail(packages, found)}"


def test_core_imports_no_plugin():
    leaks = {
        name: sorted(n for n in all_imports(path) if n.split(".")[0] in {"forgerl_plugins", "contrib"})
        for name, path in core_modules().items()
    }
    leaks = {name: found for name, found in leaks.items() if found}
    assert not leaks, f"core imports plugins: {leaks}"


def test_the_check_finds_a_cycle_only_seen_by_type_checkers(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from forgerl import errors\n"
        "if TYPE_CHECKING:\n    from forgerl.configuration.config import RunConfig\n"
    )
    modules = {"forgerl": probe, "forgerl.configuration.config": probe, "forgerl.errors": probe}
    assert imports_of(probe, modules) == {"forgerl.configuration.config", "forgerl.errors"}


def test_the_check_reads_relative_imports_and_packages(tmp_path):
    init = tmp_path / "__init__.py"
    part = tmp_path / "part.py"
    init.write_text("from .part import helper\n")
    part.write_text("if False:\n    from . import Assembler\n    from ..common import shared\n")
    modules = {"pkg.backend": init, "pkg.backend.part": part, "pkg.common": part}
    assert imports_of(init, modules, "pkg.backend") == {"pkg.backend.part"}
    assert imports_of(part, modules, "pkg.backend.part") == {"pkg.backend", "pkg.common"}
    assert cycles(graph_of(modules)) == [["pkg.backend", "pkg.backend.part"]]
    core = {"forgerl": init, "forgerl.runloop": init, "forgerl.runloop.loop": part, "forgerl.errors": part}
    assert package_of("forgerl.runloop.loop", core) == "forgerl.runloop"
    assert package_of("forgerl.errors", core) == "forgerl.errors"
    layered = package_graph({"forgerl.runloop.loop": {"forgerl.errors"}, "forgerl.errors": {"forgerl.runloop.loop"}}, core)
    assert cycles(layered) == [["forgerl.errors", "forgerl.runloop"]]
