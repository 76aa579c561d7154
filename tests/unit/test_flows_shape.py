"""The flows are thin, over one run skeleton (issue 46).

`flows/skeleton.py` holds a run once (open, plan, generate, finish and publish) and defines no flow; the modules that
define flows (`expand-dataset`, `expand-dataset-multibox`, `pilot`, the environment check) lean on it and never on
each other; no function in `flows/` runs past 80 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

FLOWS = Path(__file__).resolve().parents[2] / "flows"
LONGEST = 80


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(FLOWS.glob("*.py"))}


def _defines_flow(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(target, ast.Name) and target.id == "flow":
                    return True
                if isinstance(target, ast.Attribute) and target.attr == "flow":
                    return True
    return False


def _flow_modules_imported(tree: ast.Module) -> set[str]:
    """The modules of `flows/` that this module imports, at any depth (a function-local import counts)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("flows."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "flows":
                out.update(a.name for a in node.names)
            elif node.module.startswith("flows."):
                out.add(node.module.split(".")[1])
    return out


def test_no_flow_module_imports_another() -> None:
    trees = _trees()
    flow_modules = {name for name, tree in trees.items() if _defines_flow(tree)}
    assert {"expand_dataset", "multi_box", "pilot", "check_environment"} <= flow_modules
    crossings = {
        name: sorted(_flow_modules_imported(trees[name]) & flow_modules - {name}) for name in sorted(flow_modules)
    }
    assert {name: found for name, found in crossings.items() if found} == {}


def test_the_skeleton_is_held_once_and_defines_no_flow() -> None:
    trees = _trees()
    assert not _defines_flow(trees["skeleton"])
    for name in ("expand_dataset", "multi_box", "pilot"):
        assert "skeleton" in _flow_modules_imported(trees[name]), name


def test_no_function_in_flows_runs_past_80_lines() -> None:
    long = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 >= LONGEST
    }
    assert long == {}
