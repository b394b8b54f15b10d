"""archer's import graph has no cycle, at module level and at package level, function-level imports counted; and
every package imports only from its own row of docs/architecture.md's layer table or the rows below it, a table that
names every package.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` / ``from ... import``
anywhere in a file (module top, inside functions and methods, under ``TYPE_CHECKING``) is an edge. ``from
archer.a import b`` is an edge to the module ``archer.a.b`` when there is one, else to ``archer.a``. A package
node is one of archer's top-level packages (``archer.models``, ``archer.rollout`` with ``rollout/fast``...) or a
top-level module (``archer.batch``); docs/architecture.md draws the order these tests hold the code to.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ARCHER = Path(__file__).resolve().parent.parent / "archer"
ARCHITECTURE = ARCHER.parent / "docs" / "architecture.md"


def _module_name(path: Path, root: Path = ARCHER) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ARCHER) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The archer module an imported dotted name lives in (its longest known prefix), None outside archer."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every dotted name the file imports, wherever the statement sits; relative imports made absolute."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


@functools.cache
def module_graph(root: Path = ARCHER) -> dict[str, set[str]]:
    """module -> the archer modules it imports (itself excluded); read once per tree."""
    known = _modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = {_resolve(name, known) for name in _imported_names(tree, module, path.name == "__init__.py")}
        graph[module] = {t for t in targets if t is not None and t != module and t != "archer"}
    return graph


def package_of(module: str) -> str:
    """The top-level part of archer a module belongs to: ``archer.models`` for ``archer.models.lora``,
    ``archer.rollout`` for ``archer.rollout.fast.engine``, the module itself for ``archer.batch``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its nodes (first repeated at the end), None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_modules_import_without_cycles() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle or [])


def test_packages_import_without_cycles() -> None:
    cycle = find_cycle(package_graph(module_graph()))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def layer_table(text: str) -> list[list[str]]:
    """The rows of the layer table under "### The layers", top row first, as package names (``archer.`` left out):
    each row's leading words apart by two spaces or more, before its description (words apart by one space)."""
    block = text.split("### The layers", 1)[1].split("\n\n")[2]
    rows = []
    for line in block.splitlines():
        names = []
        for chunk in re.split(r"\s{2,}", line.strip()):
            if " " in chunk:
                break
            names.append(chunk)
        rows.append(names)
    return rows


def layer_violations(packages: dict[str, set[str]], rows: list[list[str]]) -> list[str]:
    """"source -> target" for each package import from a row above the source's own (packages outside the table
    left to test_every_package_is_in_the_layer_table)."""
    level = {f"archer.{name}": len(rows) - i for i, row in enumerate(rows) for name in row}
    return [f"{source} -> {target}" for source, targets in sorted(packages.items()) for target in sorted(targets)
            if source in level and target in level and level[target] > level[source]]


def test_every_package_is_in_the_layer_table() -> None:
    listed = [f"archer.{name}" for row in layer_table(ARCHITECTURE.read_text(encoding="utf-8")) for name in row]
    packages = set(package_graph(module_graph())) - {"archer"}
    assert sorted(packages - set(listed)) == [], "packages missing from docs/architecture.md's layer table"
    assert sorted(set(listed) - packages) == [], "the layer table names packages archer does not have"
    assert len(listed) == len(set(listed)), "a package in two rows of the layer table"


def test_packages_import_only_from_their_row_or_the_rows_below() -> None:
    rows = layer_table(ARCHITECTURE.read_text(encoding="utf-8"))
    assert layer_violations(package_graph(module_graph()), rows) == []


PURE_TORCH = {"torch", "numpy", *sys.stdlib_module_names}  # what the algorithms row may import besides archer


def test_algorithms_is_pure_torch_no_config_parsing() -> None:
    """docs/architecture.md's algorithms row is pure torch: no config objects (omegaconf, hydra) or models
    (transformers) there; reading a config section into an algorithm's settings lives with its stage."""
    outside = {}
    for path in sorted((ARCHER / "algorithms").glob("*.py")):
        names = _imported_names(ast.parse(path.read_text(encoding="utf-8")), f"archer.algorithms.{path.stem}", False)
        tops = {name.split(".")[0] for name in names} - {"archer"} - PURE_TORCH
        if tops:
            outside[path.name] = sorted(tops)
    assert outside == {}


def test_an_import_from_a_higher_row_is_a_violation() -> None:
    rows = layer_table("### The layers\n\nintro:\n\n    top                 the driver\n"
                       "    mid   side      one thing | another\n    low  base\n\nafter\n")
    assert rows == [["top"], ["mid", "side"], ["low", "base"]]
    packages = {"archer.top": {"archer.mid", "archer.low"}, "archer.mid": {"archer.side", "archer.base"},
                "archer.low": {"archer.mid", "archer.base"}, "archer.base": {"archer.top"}}
    assert layer_violations(packages, rows) == ["archer.base -> archer.top", "archer.low -> archer.mid"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "archer" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "archer"


def test_a_function_level_import_closes_a_cycle(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from archer.a.two import f\n",
        "a/two.py": "def f():\n    from archer.a import one\n    return one\n",
    })
    graph = module_graph(root)
    assert graph["archer.a.one"] == {"archer.a.two"} and graph["archer.a.two"] == {"archer.a.one"}
    assert find_cycle(graph) == ["archer.a.one", "archer.a.two", "archer.a.one"]


def test_packages_cycle_through_different_modules(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/x.py": "from archer.high import y\n",  # names a module through its package: the edge is to y
        "low/z.py": "",
        "high/__init__.py": "",
        "high/y.py": "import archer.low.z\n",
        "top.py": "from .low.z import *\n",
    })
    graph = module_graph(root)
    assert graph["archer.low.x"] == {"archer.high.y"} and graph["archer.top"] == {"archer.low.z"}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["archer.high", "archer.low", "archer.high"]


@pytest.mark.parametrize("rel, text, expected", [
    ("m/sub/leaf.py", "from .. import other\n", "archer.m.other"),
    ("m/sub/__init__.py", "from . import leaf\n", "archer.m.sub.leaf"),
    ("m/sub/leaf.py", "from . import leaf2\n", "archer.m.sub.leaf2"),
])
def test_relative_imports_resolve(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    files = {"__init__.py": "", "m/__init__.py": "", "m/other.py": "", "m/sub/__init__.py": "",
             "m/sub/leaf.py": "", "m/sub/leaf2.py": ""}
    files[rel] = text
    root = _write(tmp_path, files)
    assert expected in module_graph(root)[_module_name(root / rel, root)]
