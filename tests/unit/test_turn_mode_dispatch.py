"""No stage outside `datagen/conversation/` selects code by the turn mode: no dict indexed by its name, no branch
on its flags (issue 48).

`tests/unit/test_turn_mode_readers.py` finds comparisons with "every" / "last"; a table keyed on the mode's name
(`_JUDGES[turns.name]`) or on a flag (`_MERGES[mode.merge_unit]`), or an `if mode.continues:`, selects code by the
mode just as well and passes it. This test reads the source (every function body too) and names each place that

- indexes anything by a turn mode's `name` or flag (`x[mode.name]`, `x.get(turns.name)`, `x[mode.merge_unit]`),
- builds a mapping keyed by the modes' names (`{"last": ..., "every": ...}`),
- reads one of the mode's flags (`continues`, `ranked_by_work`, `merge_unit`, ...): they exist to be branched on.

What truly differs between the modes is the mode's to answer (its methods, in `datagen/conversation/`).
`REMAINING` lists the places not yet moved there, exactly: the test fails on a new one and on one that is gone
(then delete its entry), so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("datagen", "tasks", "flows")
ALLOWED = ("datagen/conversation/",)
MODE_NAMES = frozenset({"every", "last"})
# The flags of datagen.conversation.turn_mode.TurnMode (and what forwards them, e.g. PromptIdentity's).
MODE_FLAGS = frozenset(
    {"continues", "ranked_by_work", "merge_unit", "discards_recorded_replies", "holds_place_until_open"}
)
# Names a turn mode goes by here: `turns`, `mode`, `self.turns`, `self.mode`, `turn_mode(spec)`.
MODE_HOLDERS = frozenset({"turns", "mode", "turn_mode"})

# Pairs of bodies still picked by the mode (issue 48), as "path: what" (no line numbers: edits above them do not
# move an entry).
REMAINING = frozenset(
    {
        "datagen/identity.py: reads flag self.mode.discards_recorded_replies",
        "datagen/sources/prompts.py: reads flag identity.discards_recorded_replies",
        "tasks/pilot_turns.py: reads flag turns.continues",
        "tasks/shard_exchange.py: indexes by _MERGES[mode.merge_unit]",
        "tasks/shard_exchange.py: reads flag mode.merge_unit",
        "tasks/tokenization.py: indexes by _ROWS[turns.name]",
        "tasks/tokenization.py: maps the mode names",
        "tasks/validation.py: indexes by _JUDGES[turns.name]",
        "tasks/validation.py: maps the mode names",
        "tasks/validation.py: reads flag self.turns.continues",
        "tasks/validation.py: reads flag turns.continues",
    }
)


def _is_mode(node: ast.AST) -> bool:
    """A turn mode by the names it goes by (`turns`, `self.mode`, `turn_mode(spec)`, ...)."""
    if isinstance(node, ast.Name):
        return node.id in MODE_HOLDERS
    if isinstance(node, ast.Attribute):
        return node.attr in MODE_HOLDERS
    return isinstance(node, ast.Call) and _is_mode(node.func)


def _selects(node: ast.AST) -> bool:
    """`<mode>.name` or any `<...>.<flag>`: a value that picks one mode's code."""
    if not isinstance(node, ast.Attribute):
        return False
    return (node.attr == "name" and _is_mode(node.value)) or node.attr in MODE_FLAGS


def dispatches(source: str, where: str = "<src>") -> list[str]:
    """`where: what` of each place in `source` that selects code by a turn mode's name or flags."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, where)):
        looked_up = (  # `x.get(<mode>.name)`
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and bool(node.args)
            and _selects(node.args[0])
        )
        if (isinstance(node, ast.Subscript) and _selects(node.slice)) or looked_up:
            found.add(f"{where}: indexes by {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value in MODE_NAMES for k in node.keys
        ):
            found.add(f"{where}: maps the mode names")
        if isinstance(node, ast.Attribute) and node.attr in MODE_FLAGS and isinstance(node.ctx, ast.Load):
            found.add(f"{where}: reads flag {ast.unparse(node)}")
    return sorted(found)


def test_the_finder_finds_dict_dispatch_and_flag_branches() -> None:
    source = """
def f(turns, self, spec, x):
    a = _JUDGES[turns.name]
    b = _ROWS.get(self.turns.name)
    c = _MERGES[self.mode.merge_unit](x)
    d = {"last": 1, "every": 2}
    if turns.continues:
        pass
    e = 1 if turn_mode(spec).ranked_by_work else 2
    ok = x.name + server.name  # another thing's name
    ok2 = turns.step_key("k", 0)  # asking the mode
    log.info("%s", turns.name)  # naming it
"""
    assert [w.split(": ", 1)[1] for w in dispatches(source)] == [
        "indexes by _JUDGES[turns.name]",
        "indexes by _MERGES[self.mode.merge_unit]",
        "indexes by _ROWS.get(self.turns.name)",
        "maps the mode names",
        "reads flag self.mode.merge_unit",
        "reads flag turn_mode(spec).ranked_by_work",
        "reads flag turns.continues",
    ]


def test_no_stage_outside_the_conversation_package_selects_code_by_the_turn_mode() -> None:
    found: set[str] = set()
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(ALLOWED):
                found.update(dispatches(path.read_text(encoding="utf-8"), rel))
    new, gone = sorted(found - REMAINING), sorted(REMAINING - found)
    assert not new, "ask the run's TurnMode (a method in datagen/conversation/) instead:\n" + "\n".join(new)
    assert not gone, "moved into the mode: delete from REMAINING:\n" + "\n".join(gone)
