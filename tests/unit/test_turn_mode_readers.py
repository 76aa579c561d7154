"""One path for the turn mode: outside `datagen/conversation/`, only the memory plan looks at the mode's name.

The mode is chosen once (`datagen.conversation.turn_mode.turn_mode`, the one reader of `RunSpec.turns`); every other
place asks the `TurnMode` it was handed (its attributes and methods) and never branches on the name. The memory plan
(`datagen/engine/memory_plan.py`) is the exception: there the mode is physics (radix cache, prefix reuse), handed to
it as `TurnMode.name` by tasks/environment.py. This test reads the source (every import path, function-local code
too) and names each place that reads `<...>spec.turns` or compares something with "every" / "last".
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("datagen", "tasks", "flows")
ALLOWED = ("datagen/conversation/", "datagen/engine/memory_plan.py")
MODE_NAMES = frozenset({"every", "last"})


def _is_spec(node: ast.expr) -> bool:
    """A run spec by its name: `spec`, `run_spec`, `self.spec`, ... (RunSpec is always named so here)."""
    if isinstance(node, ast.Name):
        return node.id.endswith("spec")
    return isinstance(node, ast.Attribute) and node.attr.endswith("spec")


def _mode_names(node: ast.AST) -> bool:
    """Whether an operand is, or holds (a tuple, list or set of), the name of a mode."""
    if isinstance(node, ast.Constant):
        return node.value in MODE_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_mode_names(e) for e in node.elts)
    return False


def _reads_turns(node: ast.AST) -> bool:
    """`<...>spec.turns`, or `getattr(<anything>, "turns")`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "turns" and _is_spec(node.value)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "turns"
    )


def readers(source: str, where: str = "<src>") -> list[str]:
    """`where:line: what` of each place in `source` that reads a spec's turns or tests a mode's name."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source, where)):
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        if _reads_turns(node):
            found.append((line, col, f"{where}:{line}: reads {ast.unparse(node)}"))
        elif isinstance(node, ast.Compare) and any(_mode_names(o) for o in [node.left, *node.comparators]):
            found.append((line, col, f"{where}:{line}: compares {ast.unparse(node)}"))
        elif isinstance(node, ast.MatchValue) and _mode_names(node.value):
            found.append((line, col, f"{where}:{line}: matches case {ast.unparse(node.value)}"))
    return [what for _, _, what in sorted(found)]


def test_the_reader_finds_each_kind_of_look_at_the_mode() -> None:
    source = """
def f(spec, self, x):
    a = spec.turns
    b = self.spec.turns
    c = getattr(run_spec, "turns")
    if x == "every" or "last" != x or x in ("every", "last"):
        pass
    match x:
        case "last":
            pass
    ok = conv.turns + summary.turns  # turn counts, not a spec's mode
    ok2 = x == "everything"
"""
    assert [r.split(": ", 1)[1] for r in readers(source)] == [
        "reads spec.turns",
        "reads self.spec.turns",
        "reads getattr(run_spec, 'turns')",
        "compares x == 'every'",
        "compares 'last' != x",
        "compares x in ('every', 'last')",
        "matches case 'last'",
    ]


def test_only_the_mode_and_the_memory_plan_look_at_the_mode_name() -> None:
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(ALLOWED):
                found += readers(path.read_text(encoding="utf-8"), rel)
    assert found == [], "ask the run's TurnMode (turn_mode(spec), chosen once) instead:\n" + "\n".join(found)
