"""The tokenmill package's modules import each other without a circle.

The graph is read from the source with `ast`, not by importing: every `import` and `from ...
import` statement counts, at module level and inside functions alike (a function-level import
hides a circle from Python's import machinery but not from the reader, who still has to know
both modules to understand either). Imports under `if TYPE_CHECKING:` count too: they are
dependencies of the code's meaning even though they never run.

`from package import name` is an edge to `package.name` when that is a module, otherwise to
`package`. The implicit import of a module's parent packages is not an edge: a package's
`__init__` that imports its own submodules would otherwise always close a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

PACKAGE_DIR = Path(tokenmill.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that `module` (parsed as `tree`) imports; relative imports resolved."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: the package itself is the anchor of an __init__
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return (found & modules) - {module}


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    files = {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    return {module: imported_modules(ast.parse(path.read_text(), str(path)), module,
                                     path.name == "__init__.py", set(files))
            for module, path in files.items()}


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), each as the path
    a -> b -> ... -> a, sorted so the result is the same on every run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_circle_in(group, graph) for group in groups)


def _circle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest circle from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_no_two_modules_of_the_package_import_each_other_in_a_circle():
    circles = find_circles(import_graph())
    assert circles == [], "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_the_circle_finder_names_a_circle_and_ignores_a_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_circles(graph) == [["a", "b", "c", "a"]]
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_counts_imports_inside_functions_and_resolves_relative_ones():
    source = ("import os\nfrom . import tools\nfrom .protocol import Model\n"
              "def f():\n    from tokenmill.cli import main\n    import tokenmill.bench.serve\n")
    modules = {"tokenmill.cli", "tokenmill.bench", "tokenmill.bench.serve", "tokenmill.server",
               "tokenmill.server.api", "tokenmill.server.tools", "tokenmill.server.protocol"}
    assert imported_modules(ast.parse(source), "tokenmill.server.api", False, modules) == {
        "tokenmill.server.tools", "tokenmill.server.protocol", "tokenmill.cli", "tokenmill.bench.serve"}
    assert imported_modules(ast.parse("from . import api\nfrom .. import cli\n"), "tokenmill.server", True,
                            modules) == {"tokenmill.server.api", "tokenmill.cli"}
