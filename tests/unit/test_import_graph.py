"""The core's modules import each other without cycles, at run time and for type checking.

A cycle, even one only under ``if TYPE_CHECKING:``, means two modules are one idea that
cannot be understood or changed alone (as when ``RunContext`` carried the whole run
config). The graph is read from the source with ``ast``: an edge for every import of a
core module, at the top, inside a function or under ``TYPE_CHECKING``;
``from forgerl import x`` is an edge to ``forgerl.x`` when ``x`` is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"


def core_modules() -> dict[str, Path]:
    modules = {}
    for path in (CORE / "forgerl").rglob("*.py"):
        name = ".".join(path.relative_to(CORE).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            found |= submodules if len(submodules) == len(node.names) else {node.module, *submodules}
    return found & set(modules)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
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


def test_core_has_no_import_cycles():
    modules = core_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    found = cycles(graph)
    detail = "; ".join(
        " ".join(f"{m} -> {sorted(graph[m] & set(group))}" for m in group) for group in found
    )
    assert not found, f"import cycles in core: {detail}"


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
