"""Every-turn checkpoint lines after generation: validation per step, one token row per user turn, conversations.

The lines are real regenerated conversations built with the fixture model's chat template (tests/turn_fixtures.py);
each row is compared with the template's own `apply_chat_template(..., tools=..., tokenize=True)`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from datagen.chat import ChatTokenizer
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Reject, TokenRow
from datagen.runspec import ValidationSpec
from tasks.tokenization import TokenizationSummary
from tests.turn_fixtures import (
    WEATHER_TOOLS,
    Built,
    Step,
    Turn,
    build_conversation,
    check_published_rows,
    check_segment_rows,
    published_segment,
    stage_steps,
    template_ids,
    three_turn_tool_conversation,
)


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def _run(
    tmp_path: Path, chat: ChatTokenizer, steps: list[Completion], spec: ValidationSpec | None = None
) -> tuple[list[TokenRow], list[Reject], list[dict], TokenizationSummary]:
    """Validate and tokenize one shard of step lines; return its rows, every reject and the published lines."""
    staging, tokenized = stage_steps(chat, steps, tmp_path, spec)
    table = pq.read_table(sorted((staging / "data").glob("*.parquet"))).to_pylist()
    rows = [TokenRow(**{k: v for k, v in r.items()}) for r in table]
    rejects = [Reject(**r) for r in pq.read_table(sorted((staging / "rejects").glob("*.parquet"))).to_pylist()]
    lines = [
        json.loads(line)
        for p in sorted((staging / "conversations").glob("*.jsonl"))
        for line in p.read_text(encoding="utf-8").splitlines()
    ]
    return rows, rejects, lines, tokenized


def _shuffled_like_generation(built: Built, other: Built) -> list[Completion]:
    """Two conversations' steps interleaved as they finish, not in step order."""
    a, b = built.steps, other.steps
    out: list[Completion] = []
    for i in range(max(len(a), len(b))):
        out.extend(x[i] for x in (b, a) if i < len(x))
    return out


def test_rows_equal_the_templates_rendering_of_the_regenerated_conversation(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    """One row per user turn, equal to apply_chat_template(conversation up to its end, tools=...), loss on outputs."""
    built = three_turn_tool_conversation(chat)
    plain = build_conversation(
        chat,
        [
            Turn(
                "Name three rivers of France and where they flow.",
                (
                    Step(
                        "Three major French rivers: the Seine, the Loire and the Rhone; I will say where each goes.",
                        "The Seine flows to the Channel, the Loire to the Atlantic and the Rhone to the Mediterranean.",
                    ),
                ),
            ),
            Turn(
                "Which of them is the longest?",
                (
                    Step(
                        "The Loire is about 1,000 km long, longer than the Seine and the French part of the Rhone.",
                        "The Loire is the longest, at roughly 1,000 kilometres.",
                    ),
                ),
            ),
        ],
        prompt_id="conv-plain",
        system=None,
        plan_index=1,
    )
    rows, rejects, lines, summary = _run(tmp_path, chat, _shuffled_like_generation(built, plain))
    assert rejects == []
    by_conversation = {cid: [r for r in rows if r.conversation_id == cid] for cid in ("conv-tools", "conv-plain")}
    check_segment_rows(chat, by_conversation["conv-tools"], built)
    check_segment_rows(chat, by_conversation["conv-plain"], plain)
    tool_rows = by_conversation["conv-tools"]
    assert [r.num_loss_spans for r in tool_rows] == [1, 3, 1]
    assert [r.span_finish_reasons for r in tool_rows] == [["stop"], ["stop"] * 3, ["stop"]]
    assert [r.num_turns for r in tool_rows] == [1, 2, 3]
    # Reasoning of earlier turns is dropped by the template before the last user query: not in later rows.
    first_reasoning = chat.encode(built.segment_messages[0][2]["reasoning_content"])
    text_of_last = chat.decode(tool_rows[2].input_ids)
    assert built.segment_messages[0][2]["reasoning_content"] not in text_of_last and first_reasoning
    assert built.segment_messages[1][4]["reasoning_content"] in chat.decode(tool_rows[1].input_ids)
    # Published: one line per conversation, every kept step an assistant turn, tool turns spliced between.
    assert summary.conversations == 2 and summary.turns == 5 and summary.steps == 7
    assert [line["id"] for line in lines] == ["conv-tools", "conv-plain"]
    tools_line = lines[0]
    assert tools_line["outcome"] == "complete" and json.loads(tools_line["tools"]) == WEATHER_TOOLS
    roles = [m["role"] for m in tools_line["conversations"]]
    assert roles == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assistants = [m for m in tools_line["conversations"] if m["role"] == "assistant"]
    assert all(m["reasoning_content"] for m in assistants)
    assert [json.loads(c["function"]["arguments"]) for m in assistants for c in m.get("tool_calls", [])] == [
        {"city": "Paris", "days": 2},
        {"city": "Lyon", "days": 1},
    ]
    # The published conversation renders to the last row (plus the template's closing newline).
    published, tools = published_segment(tools_line, 2)
    assert tools == WEATHER_TOOLS
    assert template_ids(chat, published, tools) == tool_rows[2].input_ids + chat.encode("\n")
    # The same, from published data alone (the check the flow-level test runs on a real run's output).
    for line in lines:
        check_published_rows(chat, line, [asdict(r) for r in by_conversation[line["id"]]])


def _steps_with(
    chat: ChatTokenizer, bad: Step, turn: int, step: int, outcome: str = "complete", keep_calls: bool = True
) -> Built:
    """The three-turn tool conversation with step `step` of user turn `turn` replaced by `bad`."""
    built = three_turn_tool_conversation(chat)
    turns = []
    for k, t in enumerate(_turns_of(built)):
        steps = list(t.steps)
        if k == turn:
            calls = steps[step].calls if keep_calls else ()
            steps[step] = replace(bad, calls=calls, results=steps[step].results)
        turns.append(Turn(t.user, tuple(steps)))
    return build_conversation(chat, turns, prompt_id="conv-bad", tools=WEATHER_TOOLS, outcome=outcome)


def _turns_of(built: Built) -> list[Turn]:
    """The scripted turns behind the three-turn conversation (read back from its clean messages)."""
    msgs = built.segment_messages[-1]
    turns: list[Turn] = []
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "user":
            turns.append(Turn(m["content"], ()))
        elif m["role"] == "assistant":
            results = []
            j = i + 1
            while j < len(msgs) and msgs[j]["role"] == "tool":
                results.append(msgs[j]["content"])
                j += 1
            calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", []))
            step = Step(m["reasoning_content"], m["content"], calls=calls, results=tuple(results))
            turns[-1] = Turn(turns[-1].user, (*turns[-1].steps, step))
        i += 1
    return turns


PLACEHOLDER = Step("Ok.", "OK.")


def test_a_placeholder_in_the_last_turn_keeps_the_earlier_turns(chat: ChatTokenizer, tmp_path: Path) -> None:
    """The engine ended the conversation with rejected_placeholder: turns 0 and 1 are rows, turn 2 a reject row."""
    built = _steps_with(chat, PLACEHOLDER, turn=2, step=0, outcome="rejected_placeholder")
    rows, rejects, lines, _ = _run(tmp_path, chat, built.steps)
    assert [r.turn_index for r in rows] == [0, 1]
    check_segment_rows(chat, rows, built)
    assert [(r.stage, r.reason, r.prompt_id) for r in rejects] == [("validate", "placeholder", "conv-bad")]
    assert rejects[0].detail.startswith("conversation conv-bad, turn 2, step 4: ")
    assert rejects[0].request_key == "rk-conv-bad:step-4"
    assert lines[0]["outcome"] == "rejected_placeholder"
    assert [m["role"] for m in lines[0]["conversations"]].count("assistant") == 4


def test_a_placeholder_mid_turn_cuts_the_conversation_there(chat: ChatTokenizer, tmp_path: Path) -> None:
    """Validation finds a placeholder in turn 1's second step the engine let through: turn 0 stays, the rest go."""
    built = _steps_with(chat, PLACEHOLDER, turn=1, step=1, keep_calls=False)
    rows, rejects, lines, summary = _run(tmp_path, chat, built.steps)
    assert [r.turn_index for r in rows] == [0]
    check_segment_rows(chat, rows, built)
    assert [(r.reason, r.detail.split(":")[0]) for r in rejects] == [
        ("placeholder", "conversation conv-bad, turn 1, step 2"),
        ("earlier_turn_rejected", "conversation conv-bad, turn 2"),
    ]
    assert rejects[0].completion_tokens == sum(len(s.output_ids) for s in built.steps if s.turn_index == 1)
    assert lines[0]["outcome"] == "rejected_placeholder" and summary.steps == 1


@pytest.mark.parametrize(
    ("outcome", "finish", "reason"),
    [("truncated", "length", "truncated"), ("rejected_repetition", "stop", "repetition")],
)
def test_an_ending_outcome_makes_its_turn_a_reject(
    chat: ChatTokenizer, tmp_path: Path, outcome: str, finish: str, reason: str
) -> None:
    """A step whose outcome is truncated or rejected_<reason> is never a row, whatever reject_truncated says."""
    good = three_turn_tool_conversation(chat)
    last = _turns_of(good)[2].steps[0]
    built = _steps_with(chat, replace(last, finish_reason=finish), turn=2, step=0, outcome=outcome)
    rows, rejects, lines, _ = _run(tmp_path, chat, built.steps, ValidationSpec(reject_truncated=False))
    assert [r.turn_index for r in rows] == [0, 1]
    assert [(r.reason, r.detail.split(":")[0]) for r in rejects] == [(reason, "conversation conv-bad, turn 2, step 4")]
    assert lines[0]["outcome"] == outcome


def test_a_step_written_twice_is_one_reject_and_cuts_nothing(chat: ChatTokenizer, tmp_path: Path) -> None:
    built = three_turn_tool_conversation(chat)
    steps = [*built.steps[:3], built.steps[2], *built.steps[3:]]
    rows, rejects, _, _ = _run(tmp_path, chat, steps)
    check_segment_rows(chat, rows, built)
    assert [(r.reason, r.detail.split(":")[0]) for r in rejects] == [
        ("duplicate_request", "conversation conv-tools, turn 1, step 2")
    ]


def test_a_missing_step_cuts_the_conversation(chat: ChatTokenizer, tmp_path: Path) -> None:
    built = three_turn_tool_conversation(chat)
    rows, rejects, _, _ = _run(tmp_path, chat, [s for s in built.steps if s.step != 2])
    assert [r.turn_index for r in rows] == [0]
    assert [r.reason for r in rejects] == ["missing_step", "earlier_turn_rejected"]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("prompt_tokens", 1, "prompt_token_mismatch"),
        ("bridge_ids", None, "bridge_mismatch"),
        ("bridge_ids", [271], "bridge_mismatch"),
        ("messages", [], "history_mismatch"),
        ("text", "", "completion_decode_mismatch"),
    ],
)
def test_a_continuing_step_that_does_not_extend_the_row_is_a_tokenize_reject(
    chat: ChatTokenizer, tmp_path: Path, field: str, value: object, reason: str
) -> None:
    """Step 3 continues turn 1 after a tool result: its prompt must be the row so far (the server's count too)."""
    built = three_turn_tool_conversation(chat)
    step = built.steps[3]
    if field == "prompt_tokens":
        value = step.prompt_tokens + 1
    elif field == "bridge_ids" and value == [271]:
        value = [271, *(step.bridge_ids or [])[1:]]  # "\n\n" where the template writes "\n": same length
    elif field == "text":
        value = step.text.replace("Paris", "Rome")
    elif field == "messages":
        value = [m for m in step.messages if m.role != "assistant"]
    steps = [*built.steps[:3], replace(step, **{field: value}), *built.steps[4:]]
    rows, rejects, lines, _ = _run(tmp_path, chat, steps)
    assert [r.turn_index for r in rows] == [0]
    check_segment_rows(chat, rows, built)
    assert [(r.stage, r.reason, r.detail.split(":")[0]) for r in rejects] == [
        ("tokenize", reason, "conversation conv-tools, turn 1, step 3"),
        ("tokenize", "earlier_turn_rejected", "conversation conv-tools, turn 2"),
    ]
    assert lines[0]["outcome"] == f"rejected_{reason}"


def test_last_mode_lines_carry_no_turn_fields(chat: ChatTokenizer) -> None:
    """The step fields are implied by a key that names no step: `last`-mode checkpoint lines are unchanged."""
    first = three_turn_tool_conversation(chat).steps[0]
    c = replace(first, request_key=first.request_key.rpartition(":step-")[0], outcome=None)
    assert (c.step, c.turn_index) == (0, 0)
    body = json.loads(c.to_json())
    assert not {"step", "turn_index", "bridge_ids", "outcome"} & body.keys()
    last = json.loads(three_turn_tool_conversation(chat).steps[-1].to_json())
    assert list(last)[-3:] == ["step", "turn_index", "outcome"] and last["outcome"] == "complete"


def test_the_dataset_card_counts_conversations_and_turns(chat: ChatTokenizer, tmp_path: Path) -> None:
    """Every turn: the card says how many conversations and user turns; a `last` card has no such counts."""
    import yaml

    from datagen.publishing.dataset_card import Lineage, write_dataset_card
    from datagen.runspec import SamplingSpec

    _, _, _, summary = _run(tmp_path, chat, three_turn_tool_conversation(chat).steps)
    lineage = Lineage(model_fingerprint="f", template_hash="t")
    card = write_dataset_card(
        tmp_path / "card", namespace="ns", model="m", sampling=SamplingSpec(), lineage=lineage, sizes=summary.sizes()
    ).read_text(encoding="utf-8")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["datagen"]["sizes"]["num_conversations"] == 1 and front["datagen"]["sizes"]["num_turns"] == 3
    assert "- conversations: 1, user turns: 3\n- rows: 3," in card
    single = summary.model_copy(update={"conversations": 0, "turns": 0})
    plain = write_dataset_card(
        tmp_path / "plain", namespace="ns", model="m", sampling=SamplingSpec(), lineage=lineage, sizes=single.sizes()
    ).read_text(encoding="utf-8")
    assert "num_conversations" not in plain and "Each row of `data/` is one conversation:" in plain
