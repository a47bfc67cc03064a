"""No import cycles between our modules, not even ones hidden inside functions.

The module graph is read off every ``import`` statement of the packages tests/test_layers.py
lists (module level and inside functions alike; ``if TYPE_CHECKING:`` blocks aside, since
they never run), and a cycle in it fails the test naming its modules and the lines that
make it. An import inside a function still runs, so it closes a cycle as surely as one at
the top of the file: it only moves the failure to whichever module happens to be imported
first. A package's ``__init__`` is a module like any other: ``import pkg`` and ``from pkg
import name`` (``name`` not a submodule) import it; ``from pkg import sub`` (``sub`` a
submodule) imports the submodule. A module importing itself is a cycle too. Imports by
name at run time (``importlib.import_module("...")``) are not statements and are not seen.

HEXGEN_IMPORT_CYCLES_ROOT=<a checkout> points the check at another tree, e.g. an older
commit: ``git archive <commit> | tar -x -C /tmp/old`` and
``HEXGEN_IMPORT_CYCLES_ROOT=/tmp/old pytest tests/test_import_cycles.py``.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_layers import PACKAGES, ROOT


@dataclass(frozen=True)
class ImportSite:
    """One import statement: where it is and what it says."""

    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


Graph = dict[str, dict[str, list[ImportSite]]]
"""Module -> the modules it imports -> the statements that import each."""


def module_files(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of `packages` (package name -> its folder) and its file; a package's
    ``__init__.py`` is the module named by the package itself."""
    modules: dict[str, Path] = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((name, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except in ``if TYPE_CHECKING:``
    (whose ``else:`` does run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child)


def _ours(name: str, modules: Mapping[str, Path]) -> str | None:
    """`name` if it is one of our modules, else the longest prefix of it that is (an
    attribute of a module, or a module that is not on disk); None if it isn't ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, modules: Mapping[str, Path]
) -> set[str]:
    """Our modules that one import statement of `module` imports."""
    if isinstance(node, ast.Import):
        found = {_ours(alias.name, modules) for alias in node.names}
        return {name for name in found if name is not None}
    if node.level:
        is_package = modules[module].name == "__init__.py"
        base = module.split(".")
        drop = node.level - (1 if is_package else 0)
        base = base[: len(base) - drop] if drop else base
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    targets: set[str] = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        target = submodule if submodule in modules else _ours(source, modules)
        if target is not None:
            targets.add(target)
    return targets


def import_graph(packages: Mapping[str, Path]) -> Graph:
    """The module import graph of `packages` (package name -> its folder)."""
    modules = module_files(packages)
    graph: Graph = {}
    for module, path in modules.items():
        source = path.read_text()
        edges = graph.setdefault(module, {})
        for node in _imports(ast.parse(source, filename=str(path))):
            text = " ".join((ast.get_source_segment(source, node) or "").split())
            for target in _targets(node, module, modules):
                edges.setdefault(target, []).append(ImportSite(path, node.lineno, text))
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, iteratively (no recursion limit),
    each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph.get(root, {})))))
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, {})))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def import_cycles(graph: Graph) -> list[list[str]]:
    """The modules of each import cycle: a strongly connected component of two or more
    modules, or a module that imports itself."""
    return [
        component
        for component in strongly_connected(graph)
        if len(component) > 1 or component[0] in graph.get(component[0], {})
    ]


def describe(cycle: list[str], graph: Graph) -> str:
    """A cycle's modules and every import statement between them."""
    lines = [" <-> ".join(cycle)]
    members = set(cycle)
    for module in cycle:
        for target, sites in sorted(graph[module].items()):
            if target in members:
                lines.extend(f"    {module} -> {target}  ({site})" for site in sites)
    return "\n".join(lines)


def checked_packages() -> dict[str, Path]:
    """PACKAGES (those on disk), or the same folders under HEXGEN_IMPORT_CYCLES_ROOT when it
    is set."""
    other = os.environ.get("HEXGEN_IMPORT_CYCLES_ROOT")
    moved = {
        name: Path(other) / path.relative_to(ROOT) if other else path
        for name, path in PACKAGES.items()
    }
    return {name: path for name, path in moved.items() if path.is_dir()}


@functools.cache
def _our_graph() -> tuple[Graph, list[list[str]]]:
    graph = import_graph(checked_packages())
    return graph, import_cycles(graph)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package: str) -> None:
    if package not in checked_packages():
        pytest.skip(f"{package} is not in this tree")
    graph, all_cycles = _our_graph()
    cycles = [c for c in all_cycles if any(m.split(".")[0] == package for m in c)]
    report = "\n".join(describe(cycle, graph) for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) through {package}:\n{report}"


def test_the_graph_covers_every_module() -> None:
    """Each file of each package is a node, and the graph has edges."""
    graph = import_graph(PACKAGES)
    files = sum(len(list(path.rglob("*.py"))) for path in PACKAGES.values())
    assert len(graph) == files
    assert {"hexgen_flow.errors", "hexgen_flow.hardware"} <= set(graph["hexgen_flow.latency"])
    assert "hexgen_flow.latency" not in graph["hexgen_flow.roofline"]  # TYPE_CHECKING only


# The detector on a tree of its own ------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_detector_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
            "b.py": "def g():\n    from .a import f\n    return f\n",
            "c.py": "import pkg.a\n",
        },
    )
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    report = describe(["pkg.a", "pkg.b"], graph)
    assert "pkg.a -> pkg.b" in report and "a.py:1: from pkg.b import g" in report
    assert "pkg.b -> pkg.a" in report and "b.py:2: from .a import f" in report


def test_the_detector_follows_submodules_packages_and_relative_imports(tmp_path: Path) -> None:
    # pkg.sub (its __init__) -> pkg.sub.y -> pkg.sub.x -> pkg.sub: `from .. import sub` in
    # pkg/sub/x.py names the subpackage pkg.sub, so imports its __init__
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "sub/__init__.py": "from . import y\n",
            "sub/x.py": "from .. import sub\n",
            "sub/y.py": "from pkg.sub import x as _x\n",
        },
    )
    graph = import_graph({"pkg": tmp_path / "pkg"})
    init = ImportSite(tmp_path / "pkg" / "sub" / "__init__.py", 1, "from . import y")
    assert graph["pkg.sub"] == {"pkg.sub.y": [init]}
    assert set(graph["pkg.sub.x"]) == {"pkg.sub"}
    assert set(graph["pkg.sub.y"]) == {"pkg.sub.x"}
    assert set(graph["pkg"]) == set()
    assert import_cycles(graph) == [["pkg.sub", "pkg.sub.x", "pkg.sub.y"]]


def test_the_detector_passes_an_acyclic_tree(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "from pkg.a import f\n",
            "a.py": "import os\nfrom pkg import b\n\ndef f():\n    from pkg.b import g\n",
            "b.py": "import json\n\ndef g():\n    from pkg.c import h\n",
            "c.py": "from collections import abc\n",
        },
    )
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert set(graph["pkg.a"]) == {"pkg.b"}
    assert import_cycles(graph) == []


def test_the_detector_ignores_type_checking_imports(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a.py": "from pkg.b import g\n",
            "b.py": (
                "import typing\nfrom typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.a import f\n"
                "if typing.TYPE_CHECKING:\n    import pkg.a\n"
                "else:\n    import pkg.c\n"
                "def g(): ...\n"
            ),
            "c.py": "",
        },
    )
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert set(graph["pkg.b"]) == {"pkg.c"}
    assert import_cycles(graph) == []


def test_the_detector_reports_a_module_importing_itself(tmp_path: Path) -> None:
    _write(tmp_path / "pkg", {"__init__.py": "", "a.py": "def f():\n    from pkg.a import g\n"})
    assert import_cycles(import_graph({"pkg": tmp_path / "pkg"})) == [["pkg.a"]]
