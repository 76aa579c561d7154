"""`datagen inspect NS --conversation [ID]` and the namespace's conversation counts, on a namespace published to S3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.conversation.export import conversation_record
from datagen.conversation.view import find_conversation, render_conversation
from datagen.operations.inspection import inspect_namespace, list_namespaces
from datagen.publishing.storage import ObjectStore
from datagen.records import TOKEN_ROW_SCHEMA, Completion, Message, ToolCall
from flows.cli import main as cli_main
from tasks.publishing import publish

REASONING = "Let me think about the weather. " * 40 + "So I call the tool."
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object"}}},
]
# Every-turn mode: two user turns, the first answered after a tool call, the second ended by a divergent call.
EVERY = {
    "id": "conv-every",
    "conversations": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "\n\n",
            "reasoning_content": REASONING,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "The tool said 21."},
        {"role": "user", "content": "And tomorrow?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Another call.",
            # Arguments as an object (not JSON text): read tolerantly.
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"day": 2}}}],
        },
    ],
    "tools": json.dumps(TOOLS),
    "outcome": "tool_call_divergence",
}
# A `last` mode line: no outcome, tools as a list, list content.
LAST = {
    "id": "conv-last",
    "conversations": [
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hi", "reasoning_content": "Short."},
    ],
    "tools": TOOLS,
}


def _row(conversation: str, turn: int, spans: int) -> dict[str, Any]:
    return {
        "prompt_id": conversation, "source": "s", "category": None, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
        "prompt_tokens": 1, "completion_tokens": 2, "finish_reason": "stop", "request_key": f"k-{conversation}",
        "num_turns": 1, "normalized": None, "conversation_id": conversation, "turn_index": turn,
        "num_loss_spans": spans, "span_finish_reasons": ["stop"] * spans,
    }  # fmt: skip


def _publish(store: ObjectStore, root: Path, namespace: str) -> None:
    (root / "data").mkdir(parents=True)
    (root / "conversations").mkdir()
    rows = [_row("conv-last", 0, 1), _row("conv-every", 0, 2), _row("conv-every", 1, 1)]
    pq.write_table(pa.Table.from_pylist(rows, schema=TOKEN_ROW_SCHEMA), root / "data" / "train-00000-of-00001.parquet")
    lines = [LAST, EVERY, {**EVERY, "conversations": EVERY["conversations"][:5]}]  # an earlier, shorter line too
    (root / "conversations" / "conversations-00000-of-00002.jsonl").write_text(json.dumps(lines[0]) + "\n")
    (root / "conversations" / "conversations-00001-of-00002.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines[1:])
    )
    turns = {
        "conversations_planned": 3,
        "conversations_finished": 2,
        "steps": 5,
        "user_turns": 3,
        "conversations_by_outcome": {"complete": 1, "tool_call_divergence": 1},
    }
    publish(root, namespace, store, {"model_path": "m", "engine": "standin", "rows": 3, "conversations": turns})


def test_inspect_counts_conversations_and_shows_one_readably(s3_store: ObjectStore, tmp_path: Path) -> None:
    _publish(s3_store, tmp_path / "ds", "conv_v1")
    text, ok = inspect_namespace(s3_store, "conv_v1")
    assert ok, text
    assert (
        "conversations: 2 finished of 3 planned; 5 steps generated, 3 user turns answered; "
        "ended: complete 1, tool_call_divergence 1"
    ) in text
    assert "conversations in the rows: 2 in 3 rows (user-turn segments), 4 loss spans" in text
    assert "datagen inspect conv_v1 --conversation [ID]" in text
    assert "conv_v1  published" in list_namespaces(s3_store) and "3 rows from 2 conversations" in list_namespaces(
        s3_store
    )

    first = find_conversation(s3_store, "conv_v1", None)
    assert first is not None and first.record["id"] == "conv-last" and first.line == 1
    shown = render_conversation(first)
    assert "outcome: not recorded" in shown and "tools: get_weather, get_forecast" in shown
    assert "  Say hi" in shown  # list content as its text

    found = find_conversation(s3_store, "conv_v1", "conv-every")
    assert found is not None and found.same_id == 2 and found.line == 1  # the longer of the two lines
    shown = render_conversation(found)
    assert "outcome: tool_call_divergence" in shown
    assert "turns: 2 user, 3 assistant, 1 tool" in shown
    assert "── SYSTEM" in shown and "── TOOL (get_weather)" in shown and shown.count("── ASSISTANT") == 3
    assert f"reasoning ({len(REASONING):,} characters):" in shown
    assert "characters…]" in shown and REASONING not in shown  # shortened: its start and its end
    assert "So I call the tool." in shown
    assert '→ calls get_weather({"city": "Paris"})' in shown and '→ calls get_weather({"day": 2})' in shown
    assert find_conversation(s3_store, "conv_v1", "no-such-id") is None


def test_lines_stream_across_chunk_boundaries(s3_store: ObjectStore, tmp_path: Path) -> None:
    _publish(s3_store, tmp_path / "ds", "conv_v2")
    key = "conv_v2/conversations/conversations-00001-of-00002.jsonl"
    whole = s3_store.get_bytes(key)
    assert list(s3_store.iter_lines(key, chunk_size=7)) == whole.split(b"\n")[:-1]


def test_inspect_command_shows_a_conversation(
    s3_store: ObjectStore,
    local_s3: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _publish(s3_store, tmp_path / "ds", "conv_v3")
    for key, value in local_s3.settings(s3_prefix=s3_store.prefix).model_dump().items():  # type: ignore[attr-defined]
        if value is not None and key.startswith("s3_"):
            raw = value.get_secret_value() if hasattr(value, "get_secret_value") else value
            monkeypatch.setenv(f"DATAGEN_{key.upper()}", str(raw))
    state = ["--state-dir", str(tmp_path / "no-stack")]
    assert cli_main(["inspect", "conv_v3", "--conversation", "conv-every", *state]) == 0
    assert "outcome: tool_call_divergence" in capsys.readouterr().out
    assert cli_main(["inspect", "conv_v3", "--conversation", *state]) == 0
    assert "conversation conv-last" in capsys.readouterr().out
    assert cli_main(["inspect", "conv_v3", "--conversation", "nope", *state]) == 1
    assert "no conversation with id 'nope'" in capsys.readouterr().err
    assert cli_main(["inspect", "--conversation", *state]) == 2


def test_a_conversation_as_the_exporter_writes_it_reads_back(s3_store: ObjectStore, tmp_path: Path) -> None:
    # The line as datagen.conversation.export writes it today (`last` mode): reasoning split at </think>,
    # the model's call with its arguments as JSON text, tools as JSON text.
    completion = Completion(
        prompt_id="p-1",
        source="s",
        row=0,
        messages=[Message("user", "Weather in Paris?")],
        request_key="k",
        prompt_tokens=5,
        output_ids=[1, 2],
        text="I should call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>",
        finish_reason="stop",
        completion_tokens=2,
        tools=TOOLS,
        tool_calls=[ToolCall("get_weather", {"city": "Paris"})],
    )
    root = tmp_path / "ds"
    (root / "conversations").mkdir(parents=True)
    record = conversation_record([completion], enable_thinking=True)
    (root / "conversations" / "conversations-00000-of-00001.jsonl").write_text(json.dumps(record) + "\n")
    publish(root, "conv_export", s3_store, {"model_path": "m", "engine": "standin"})
    found = find_conversation(s3_store, "conv_export", "p-1")
    assert found is not None
    shown = render_conversation(found)
    assert "outcome: not recorded" in shown and "turns: 1 user, 1 assistant, 0 tool" in shown
    assert "│ I should call the tool." in shown and '→ calls get_weather({"city": "Paris"})' in shown
    assert "<tool_call>" not in shown  # the exporter keeps only the visible text before the call
