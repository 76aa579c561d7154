"""Validation and tokenization read a shard as the run's turn mode says, never by the shape of its lines.

The mode (datagen/conversation/turn_mode.py) gathers a shard's lines into conversations: a `last` line is a
conversation of one step, every-turn lines of one prompt are its steps. Issue 34: the readers used to ask each line
which mode wrote it (`is_step`, a regex for `"step": N, "turn_index": M` in the line's text).
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.turn_mode import EveryTurn, LastTurn, TurnMode
from datagen.identity import prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Reject, TokenRow
from datagen.runspec import ValidationSpec
from tasks.tokenization import TokenizationSummary, tokenize_accepted
from tasks.validation import ValidationSummary, validate_shards
from tests.turn_fixtures import check_segment_rows, stage_steps, three_turn_tool_conversation

ROOT = Path(__file__).resolve().parents[2]
ANSWER = "The user asks about tides, so I will name the moon.\n</think>\n\nTides follow the moon's pull on the oceans."


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def _validate(paths: list[Path], out: Path, turns: TurnMode) -> ValidationSummary:
    return validate_shards(paths, out, ValidationSpec(), True, turns=turns)


def _tokenize(paths: list[Path], staging: Path, chat: ChatTokenizer, turns: TurnMode) -> TokenizationSummary:
    return tokenize_accepted(paths, staging, chat, True, turns=turns)


def _last_line(chat: ChatTokenizer, question: str, meta: dict[str, object]) -> Completion:
    messages = [{"role": "user", "content": question}]
    ids = [*chat.encode(ANSWER), IM_END_ID]
    pid = prompt_id_from_messages("src", messages)
    return Completion(
        prompt_id=pid,
        source="src",
        row=0,
        messages=messages,
        request_key=f"rk-{pid}",
        prompt_tokens=len(chat.prompt_ids(messages, True)),
        output_ids=ids,
        text=ANSWER,
        finish_reason="stop",
        completion_tokens=len(ids),
        meta=meta,
    )


def test_a_last_line_whose_meta_names_a_step_is_still_one_line_in_file_order(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    # Lines without a plan position keep their file order, so the first copy of a duplicate is kept. The source's
    # own `step`/`turn_index` in `meta` once made the first line look like an every-turn step and moved it last.
    first = _last_line(chat, "Why are there tides?", {"step": 0, "turn_index": 0})
    second = _last_line(chat, "What causes the tides?", {})
    assert first.to_json().count('"step": 0, "turn_index": 0') == 1
    shard = tmp_path / "shard-00000.completions.jsonl"
    shard.write_text(first.to_json() + "\n" + second.to_json() + "\n", encoding="utf-8")
    summary = _validate([shard], tmp_path / "out", LastTurn())
    accepted = Path(summary.accepted_paths[0]).read_text(encoding="utf-8").splitlines()
    assert accepted == [first.to_json()]  # byte-identical, its meta included
    [dup] = [Reject.from_json(line) for line in Path(summary.reject_paths[0]).read_text().splitlines()]
    assert (dup.reason, dup.prompt_id) == ("duplicate_completion", second.prompt_id)


def test_a_stray_last_line_in_an_every_turn_shard_is_a_reject_and_cuts_nothing(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    # A line of the same prompt written by a `last` run (its key has no `:step-N`): every turn publishes
    # conversations only, so it is a reject row of its own and the conversation's rows are all kept.
    built = three_turn_tool_conversation(chat)
    stray = replace(built.steps[-1], step=None, turn_index=None, outcome=None, request_key="rk-conv-tools")
    assert '"step"' not in stray.to_json()
    staging, tokenized = stage_steps(chat, [stray, *built.steps], tmp_path)
    table = pq.read_table(sorted((staging / "data").glob("*.parquet"))).to_pylist()
    check_segment_rows(chat, [TokenRow(**r) for r in table], built)
    rejects = [Reject(**r) for r in pq.read_table(sorted((staging / "rejects").glob("*.parquet"))).to_pylist()]
    assert [(r.stage, r.reason, r.request_key) for r in rejects] == [("validate", "missing_step", "rk-conv-tools")]
    assert (tokenized.conversations, tokenized.turns, tokenized.steps) == (1, 3, len(built.steps))


@pytest.mark.parametrize(("turns", "counted"), [(LastTurn(), (0, 0, 0)), (EveryTurn(), (1, 1, 1))])
def test_the_turn_mode_not_the_line_decides_how_a_line_becomes_rows(
    chat: ChatTokenizer, tmp_path: Path, turns: TurnMode, counted: tuple[int, int, int]
) -> None:
    # The first step of a conversation, as an accepted file: under `last` it is one row of its own, counted as no
    # conversation; under `every` it is a conversation of one segment.
    step = three_turn_tool_conversation(chat).steps[0]
    shard = tmp_path / "shard-00000.accepted.jsonl"
    shard.write_text(step.to_json() + "\n", encoding="utf-8")
    summary = _tokenize([shard], tmp_path / "staging", chat, turns)
    assert (summary.rows, summary.rejects_total) == (1, 0)
    assert (summary.conversations, summary.turns, summary.steps) == counted


def _mode_sniffing(tree: ast.AST) -> list[str]:
    """Where a module asks a record which turn mode wrote it."""
    found: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Attribute)
            and node.left.attr == "step"
            and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
            and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
        ):
            found.append(f"{node.lineno}: .step is (not) None")
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in {"is_step", "is_step_row"}:
            found.append(f"{node.lineno}: {name}")
        if isinstance(node, ast.alias) and node.name in {"is_step", "is_step_row"}:
            found.append(f"import {node.name}")
    return found


def test_no_reader_outside_the_conversation_package_asks_a_record_its_mode() -> None:
    offenders = {
        str(path.relative_to(ROOT)): hits
        for top in ("datagen", "tasks", "flows")
        for path in sorted((ROOT / top).rglob("*.py"))
        if "conversation" not in path.relative_to(ROOT).parts
        and (hits := _mode_sniffing(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert offenders == {}


def test_the_sniffing_finder_finds_what_it_looks_for() -> None:
    code = "from x import is_step\nif c.step is None:\n    pass\nok = c.step == 2\n"
    assert _mode_sniffing(ast.parse(code)) == ["import is_step", "2: .step is (not) None"]
