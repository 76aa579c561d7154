"""The module graph of the package: no import circles, and no arrow back up the layers.

Layers, lowest first: `datagen` (the library: records, engine, checks, ...), `tasks` (stage bodies), `flows`
(orchestration, and the command line that starts the flows: `flows.cli`). A module imports from its own layer or a
lower one, with no exception; every import counts, a function-local one too (a circle hidden inside a function is
still a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("datagen", "tasks", "flows")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (ours only; `from pkg import mod` counts as pkg.mod)."""
    files = {_module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_hidden_imports_and_circles() -> None:
    graph = _graph()
    assert "tasks.shard_generation" in graph["tasks.generation"]
    # Subpackages count as their modules: the one shard driver builds on the conversation package.
    assert {"datagen.conversation.turn_mode", "datagen.conversation.ledger"} <= graph["tasks.generation"]
    assert "datagen.conversation.turn_mode" in graph["datagen.conversation.ledger"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_no_arrow_runs_back_up_the_layers() -> None:
    def rank(module: str) -> int:
        return LAYERS.index(module.split(".")[0])

    graph = _graph()
    assert {"flows.cli", "datagen.worker", "datagen.pinned_flow_run"} <= set(graph)  # the entry points are read
    upward = sorted(f"{s} -> {t}" for s, targets in graph.items() for t in targets if rank(t) > rank(s))
    assert upward == []
