"""Every user turn of an every-turn conversation ends as a row or a reject, and validation counts what it judged
(issue 47, items 7 and the report's "Answer tokens").

Real checkpoint lines of a three-user-turn conversation (tests/turn_fixtures.py, the fixture model's template) go
through the real validation (with the shard's prompts and generation rejects, as the flow passes them) and
tokenization. Before issue 47 the turns after an early end were in no row and no reject, and every accepted step
counted 0 answer tokens.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from datagen.chat import ChatTokenizer
from datagen.checks.quality import GateReport, render_validation_report
from datagen.conversation.turn_mode import EveryTurn
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Message, Prompt, Reject
from datagen.runspec import ValidationSpec
from tasks.tokenization import tokenize_accepted
from tasks.validation import ShardValidator
from tests.turn_fixtures import Built, three_turn_tool_conversation


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def _prompt(built: Built) -> Prompt:
    """The recorded row behind the built conversation (its trailing reply dropped, as the loader gives it)."""
    messages = [Message.from_dict(m) for m in built.segment_messages[-1][:-1]]
    return Prompt("conv-tools", "conversations.jsonl", 0, messages, tools=built.tools, location="c.jsonl:1")


def _run(
    chat: ChatTokenizer, tmp_path: Path, built: Built, lines: list[Completion], rejects: list[Reject] = ()
) -> tuple[ShardValidator, list[Reject], list[dict[str, object]]]:
    """Validate and tokenize one shard as the flow does; (validator, every reject row, every token row)."""
    shards = tmp_path / "shards"
    shards.mkdir(parents=True)
    prompts = shards / "shard-00000.prompts.jsonl"
    prompts.write_text(_prompt(built).to_json() + "\n", encoding="utf-8")
    completions = shards / "shard-00000.completions.jsonl"
    completions.write_text("".join(c.to_json() + "\n" for c in lines), encoding="utf-8")
    generation = shards / "shard-00000.rejects.jsonl"
    generation.write_text("".join(r.to_json() + "\n" for r in rejects), encoding="utf-8")
    validator = ShardValidator(tmp_path / "validated", ValidationSpec(), True, turns=EveryTurn())
    accepted, validation_rejects = validator.add(completions, prompts, generation)
    validator.close()
    staging = tmp_path / "staging"
    tokenize_accepted(
        [accepted], staging, chat, True, extra_reject_paths=[generation, validation_rejects], turns=EveryTurn()
    )
    out = [Reject(**r) for f in sorted((staging / "rejects").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    rows = [r for f in sorted((staging / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    return validator, out, rows


def _turns(rejects: list[Reject], rows: list[dict[str, object]]) -> list[int]:
    """The user turns the rows and the rejects name, in order (a generation reject names its step, not its turn)."""
    named = [int(m.group(1)) for r in rejects if (m := re.search(r", turn (\d+)", r.detail))]
    return sorted([int(str(r["turn_index"])) for r in rows] + named)


def test_a_conversation_that_ends_early_rejects_each_turn_it_never_reached(chat: ChatTokenizer, tmp_path: Path) -> None:
    built = three_turn_tool_conversation(chat)
    first = replace(built.steps[0], outcome="tool_call_divergence")  # ended on its first step
    validator, rejects, rows = _run(chat, tmp_path, built, [first])
    assert [r.reason for r in rejects] == ["earlier_turn_rejected"] * 2
    assert rejects[0].detail == (
        "conversation conv-tools, turn 1: not generated: the conversation ended at turn 0 (tool_call_divergence)"
    )
    assert _turns(rejects, rows) == [0, 1, 2]  # every user turn: a row or a reject
    assert all(r.location == "c.jsonl:1" and r.stage == "validate" for r in rejects)
    assert validator.summary.conversation_outcomes == {"tool_call_divergence": 1}


def test_a_conversation_cut_at_validation_rejects_the_turns_never_generated_too(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    built = three_turn_tool_conversation(chat)
    # A placeholder: two answer tokens after no reasoning; the engine ended the conversation on it.
    placeholder = replace(
        built.steps[0], text="\n</think>\n\nOK.", output_ids=[*chat.encode("\n</think>\n\nOK."), 248046]
    )
    placeholder = replace(placeholder, completion_tokens=len(placeholder.output_ids), outcome="rejected_placeholder")
    validator, rejects, rows = _run(chat, tmp_path, built, [placeholder])
    assert rows == [] and [r.reason for r in rejects] == [
        "placeholder",
        "earlier_turn_rejected",
        "earlier_turn_rejected",
    ]
    assert _turns(rejects, rows) == [0, 1, 2]
    assert validator.summary.conversation_outcomes == {"rejected_placeholder": 1}


def test_a_generation_reject_ends_its_conversation_and_the_later_turns_are_rejects(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    built = three_turn_tool_conversation(chat)
    refused = Reject(
        "generate", "server_rejected", "conversation conv-tools, step 1: gpu0: 400", "conversations.jsonl", 0,
        "conv-tools", request_key="rk-conv-tools:step-1", location="c.jsonl:1",
    )  # fmt: skip
    validator, rejects, rows = _run(chat, tmp_path, built, built.steps[:1], [refused])
    # Turn 0 made its row, turn 1's step was refused (its reject), turn 2 was never reached.
    assert [r.reason for r in rejects] == ["server_rejected", "earlier_turn_rejected"]
    assert "turn 2: not generated: the conversation ended at turn 1 (server_rejected)" in rejects[1].detail
    assert [r["turn_index"] for r in rows] == [0]
    assert validator.summary.conversation_outcomes == {"server_rejected": 1}

    # Refused at its very first step: no line at all, the reject stands for turn 0, the others are rows of their own.
    first = replace(refused, request_key="rk-conv-tools:step-0")
    validator, rejects, rows = _run(chat, tmp_path / "again", built, [], [first])
    assert [r.reason for r in rejects] == ["server_rejected", "earlier_turn_rejected", "earlier_turn_rejected"]
    assert rows == [] and validator.summary.conversation_outcomes == {"server_rejected": 1}


def test_a_whole_conversation_counts_its_answer_tokens_and_rejects_nothing(chat: ChatTokenizer, tmp_path: Path) -> None:
    built = three_turn_tool_conversation(chat)
    validator, rejects, rows = _run(chat, tmp_path, built, built.steps)
    assert rejects == [] and [r["turn_index"] for r in rows] == [0, 1, 2]
    summary = validator.summary
    # Every accepted step's answer (after </think>) counted: the report's "Answer tokens" was all zeros.
    assert summary.accepted == 5 and summary.answer_tokens.total > 5 * 5 and 0 not in summary.answer_tokens.counts
    report = render_validation_report(summary, GateReport(passed=True, checks=[], evidence=[], reject_files=[]))
    answers = report.split("## Answer tokens", 1)[1]
    assert "(no accepted samples)" not in answers and f"| {summary.answer_tokens.mean:.1f} |" in answers
    assert summary.conversation_outcomes == {"complete": 1}
