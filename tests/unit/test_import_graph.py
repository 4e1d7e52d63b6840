"""The package's import graph: no cycles, function-level imports included, and ``tree/`` imports
nothing of ``probe_mtp`` (it is the model-free token-tree package)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"probe_mtp": ROOT / "probe_mtp", "probe_mtp.tree": ROOT / "tree"}


def module_files() -> dict[str, Path]:
    """Every module of probe_mtp/ and tree/ by its dotted name (a package by its ``__init__``)."""
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (top level or inside functions).
    ``from X import Y`` counts as an import of ``X.Y`` when that is a module, else of ``X``."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def import_graph() -> nx.DiGraph:
    modules = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in imports_of(name, path, modules))
    return graph


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "probe_mtp.decoder" in graph and "probe_mtp.tree.layout" in graph
    assert graph.has_edge("probe_mtp.generate", "probe_mtp.decoder")
    assert graph.has_edge("probe_mtp.step", "probe_mtp.kv")


def test_no_import_cycles():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_tree_imports_nothing_of_probe_mtp():
    graph = import_graph()
    outside = {(a, b) for a, b in graph.edges if a.startswith("probe_mtp.tree") and not b.startswith("probe_mtp.tree")}
    assert not outside
    for path in PACKAGES["probe_mtp.tree"].rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "probe_mtp" not in text.replace("probe_mtp.tree", ""), f"{path.name} names probe_mtp"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                raise AssertionError(f"{path.name} imports from above tree/ (level {node.level})")
