"""Tool-calling conversations: what loads (OpenAI, ShareGPT), what is refused and where, and that a loaded row
renders exactly as the model's own chat template renders the row itself (tools included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from datagen.chat import ChatTokenizer
from datagen.identity import PromptIdentity, content_prompt_id, prompt_id_from_ids, prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Message, Prompt, Reject, ToolCall
from datagen.runspec import PromptSource
from datagen.sources.preparation import Preparer
from datagen.sources.prompts import LOAD_REJECT_REASONS, iter_prompts

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.shared(ensure_model_dir())


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def load(path: Path, identity: PromptIdentity | None = None, **kw: Any) -> tuple[list[Prompt], list[Reject]]:
    items = list(iter_prompts([PromptSource(path=str(path), **kw)], identity=identity))
    return [i for i in items if isinstance(i, Prompt)], [i for i in items if isinstance(i, Reject)]


OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "You help with travel."},
        {"role": "user", "content": "Weather in Oslo for 2 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 4, "sky": "snow"}'},
        {"role": "assistant", "content": "Snow, about 4 C."},
    ],
    "tools": [WEATHER],
}
SHAREGPT_ROW = {
    "conversations": [
        {"from": "system", "value": "You help with travel."},
        {"from": "human", "value": "Weather in Oslo for 2 days?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'},
        {"from": "observation", "value": '{"temp_c": 4, "sky": "snow"}'},
        {"from": "gpt", "value": "Snow, about 4 C."},
    ],
    "tools": json.dumps([WEATHER]),
}


def test_openai_and_sharegpt_tool_conversations_load_to_the_same_messages(tmp_path: Path) -> None:
    prompts, rejects = load(write_jsonl(tmp_path / "t.jsonl", [OPENAI_ROW, SHAREGPT_ROW]))
    assert rejects == []
    a, b = prompts
    assert a.tools == b.tools == [WEATHER]
    assert [m.role for m in a.messages] == ["system", "user", "assistant", "tool"]
    assert a.messages[2].tool_calls == (ToolCall("get_weather", {"city": "Oslo", "days": 2}, id="call_1"),)
    assert a.messages[3] == Message(role="tool", content='{"temp_c": 4, "sky": "snow"}', tool_call_id="call_1")
    # The same conversation in both forms: the same turns apart from the ids only OpenAI rows carry.
    strip = [Message(m.role, m.text, m.reasoning_content, _no_ids(m.tool_calls)) for m in a.messages]
    assert strip == [Message(m.role, m.text, m.reasoning_content, m.tool_calls) for m in b.messages]


def _no_ids(calls: tuple[ToolCall, ...] | None) -> tuple[ToolCall, ...] | None:
    return None if calls is None else tuple(ToolCall(c.name, c.arguments) for c in calls)


def test_loaded_tool_rows_render_as_the_real_template_renders_the_rows(tmp_path: Path, chat: ChatTokenizer) -> None:
    identity = PromptIdentity(Preparer(chat, True, 100_000))
    prompts, rejects = load(write_jsonl(tmp_path / "t.jsonl", [OPENAI_ROW, SHAREGPT_ROW]), identity=identity)
    # Both forms of one conversation render to the same ids: the second is the first's duplicate.
    assert [r.reason for r in rejects] == ["duplicate_prompt"]
    # The judge: the template given the OpenAI row itself (arguments as objects, trailing reply dropped).
    row = json.loads(json.dumps(OPENAI_ROW["messages"][:-1]))
    row[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo", "days": 2}
    expected = chat._hf.apply_chat_template(
        row, tools=[WEATHER], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert "<tools>" in expected and "<tool_call>\n<function=get_weather>" in expected
    for p in prompts:
        assert p.input_ids is not None
        assert chat.decode(list(p.input_ids)) == expected
        assert p.prompt_id == content_prompt_id(expected)
        assert p.alias == prompt_id_from_ids(p.source, chat.encode(expected))


def test_tools_without_tool_turns_render_with_their_definitions(tmp_path: Path, chat: ChatTokenizer) -> None:
    identity = PromptIdentity(Preparer(chat, True, 100_000))
    rows = [{"messages": [{"role": "user", "content": "Is it cold in Oslo?"}], "tools": [WEATHER]}]
    (p,), _ = load(write_jsonl(tmp_path / "t.jsonl", rows), identity=identity)
    expected = chat._hf.apply_chat_template(
        rows[0]["messages"], tools=[WEATHER], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert p.input_ids is not None and chat.decode(list(p.input_ids)) == expected
    plain = chat.prompt_ids(rows[0]["messages"], True)
    assert len(p.input_ids) > len(plain) + 50  # the definitions are there, not only the question


def test_source_tools_apply_to_rows_without_their_own(tmp_path: Path) -> None:
    other = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
    rows = [
        {"messages": [{"role": "user", "content": "q"}]},
        {"messages": [{"role": "user", "content": "q"}], "tools": [other]},
    ]
    prompts, rejects = load(write_jsonl(tmp_path / "t.jsonl", rows), tools=[WEATHER])
    assert rejects == [] and [p.tools for p in prompts] == [[WEATHER], [other]]


def test_rows_without_tools_keep_their_ids(tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ]
        }
    ]
    (p,), _ = load(write_jsonl(tmp_path / "t.jsonl", rows))
    assert p.tools is None
    assert p.prompt_id == prompt_id_from_messages(
        "t",
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}],
    )
    assert '"tools"' not in p.to_json()
    (with_tools,), _ = load(write_jsonl(tmp_path / "t.jsonl", [{**rows[0], "tools": [WEATHER]}]))
    assert with_tools.prompt_id != p.prompt_id


def test_history_with_reasoning_and_think_block_renders_as_the_real_template(
    tmp_path: Path, chat: ChatTokenizer
) -> None:
    """An assistant turn with both `reasoning_content` and a `<think>` block in its content: the template keeps the
    content whole (its split happens only without reasoning_content); the loader used to drop the reasoning."""
    turns = [
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "user", "content": "Plan a trip."},
        {
            "role": "assistant",
            "content": "<think>\nold thought\n</think>\n\nGo north.",
            "reasoning_content": "real thought",
        },
        # A last user message that is itself tool-response text: the template's last query stays at turn 1,
        # so the assistant turn after it keeps its reasoning.
        {"role": "user", "content": '<tool_response>\n{"ok": true}\n</tool_response>'},
    ]
    identity = PromptIdentity(Preparer(chat, True, 100_000))
    (p,), rejects = load(write_jsonl(tmp_path / "t.jsonl", [{"messages": turns}]), identity=identity)
    assert rejects == []
    expected = chat._hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert "real thought" in expected  # reasoning kept: the last user message is tool-response text
    assert p.input_ids is not None and chat.decode(list(p.input_ids)) == expected


def test_bare_string_part_is_refused_where_the_template_raises(tmp_path: Path, chat: ChatTokenizer) -> None:
    turns = [{"role": "user", "content": ["plain string part", {"type": "text", "text": "x"}]}]
    with pytest.raises(Exception, match="Unexpected item type"):
        chat._hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    _, (r,) = load(write_jsonl(tmp_path / "t.jsonl", [{"messages": turns}]))
    assert (r.reason, r.location) == ("wrong_type", f"{tmp_path / 't.jsonl'}:1")
    assert "messages[0].content[0] must be an object, got str" in r.detail


@pytest.mark.parametrize(
    ("row", "reason", "detail"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}], "tools": {"name": "x"}},
            "bad_tools",
            "'tools' must be a list",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}], "tools": "[{"},
            "bad_tools",
            "'tools' is text that is not JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {}}]},
            "bad_tools",
            "tools[0] has no function name",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    },
                    {"role": "tool", "content": "r"},
                ]
            },
            "bad_tool_call",
            "messages[1].content tool_calls[0]: arguments are not JSON",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": "not json"},
                    {"from": "observation", "value": "r"},
                ]
            },
            "bad_tool_call",
            "conversations[1].value: function call is not JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]},
            "bad_tool_turn",
            "messages[1].content: a tool result that follows no assistant tool call",
        ),
    ],
)
def test_malformed_tool_rows_are_load_rejects_with_reason_and_place(
    tmp_path: Path, row: dict[str, Any], reason: str, detail: str
) -> None:
    f = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "good"}]}, row])
    prompts, (r,) = load(f)
    assert len(prompts) == 1
    assert r.reason == reason and r.reason in LOAD_REJECT_REASONS
    assert r.location == f"{f}:2" and detail in r.detail, r.detail


def test_sharegpt_reply_with_a_trailing_call_is_dropped_whole(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "Let me look."},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        ]
    }
    (p,), rejects = load(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert rejects == [] and [m.role for m in p.messages] == ["user"]


def test_sharegpt_text_then_call_is_one_assistant_turn(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "Let me look."},
            {
                "from": "function_call",
                "value": '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1}}]',
            },
            {"from": "observation", "value": "r1"},
            {"from": "observation", "value": "r2"},
        ]
    }
    (p,), rejects = load(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert rejects == []
    assert [m.role for m in p.messages] == ["user", "assistant", "tool", "tool"]
    assert p.messages[1] == Message(
        "assistant", "Let me look.", tool_calls=(ToolCall("a", {}), ToolCall("b", {"k": 1}))
    )


def test_prompt_with_tools_round_trips_through_its_json_line(tmp_path: Path) -> None:
    (p,), _ = load(write_jsonl(tmp_path / "t.jsonl", [OPENAI_ROW]))
    back = Prompt.from_json(p.to_json())
    assert back == p and back.tools == [WEATHER]


def _qwen25_row(call_text: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "Weather in Oslo for 2 days?"},
            {"role": "assistant", "content": f"Let me check.\n{call_text}"},
            {"role": "tool", "content": '{"temp_c": 4}'},
            {"role": "assistant", "content": "Snow, about 4 C."},
        ],
        "tools": [WEATHER],
    }


def test_a_recorded_qwen25_json_call_in_the_content_is_a_call(tmp_path: Path, chat: ChatTokenizer) -> None:
    # Issue 35.8: the call stayed text, and the tool result after it was refused as bad_tool_turn.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    identity = PromptIdentity(Preparer(chat, True, 100_000))
    (p,), rejects = load(write_jsonl(tmp_path / "t.jsonl", [_qwen25_row(call)]), identity=identity)
    assert rejects == []
    assert p.messages[1] == Message(
        "assistant", "Let me check.", tool_calls=(ToolCall("get_weather", {"city": "Oslo", "days": 2}),)
    )
    # The same call given as OpenAI tool_calls loads to the same prompt.
    openai = _qwen25_row("")
    openai["messages"][1] = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
        ],
    }
    (q,), _ = load(write_jsonl(tmp_path / "o.jsonl", [openai]), identity=identity)
    assert p.input_ids == q.input_ids


@pytest.mark.parametrize(
    ("call_text", "detail"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "the call is not JSON"),
        ('<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>', "has no function name"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {}}', "not a JSON call closed by </tool_call>"),
    ],
)
def test_a_broken_qwen25_call_is_a_reject_that_names_the_call(tmp_path: Path, call_text: str, detail: str) -> None:
    f = write_jsonl(tmp_path / "bad.jsonl", [_qwen25_row(call_text)])
    _, (r,) = load(f)
    assert r.reason == "bad_tool_call" and r.location == f"{f}:1"
    assert "messages[1].content <tool_call> 0" in r.detail and detail in r.detail, r.detail


def test_the_same_prompt_in_two_sources_is_planned_once_under_the_first(tmp_path: Path, chat: ChatTokenizer) -> None:
    # Issue 35.5: the prompt id holds the source label, so one conversation given in OpenAI form in one source and in
    # ShareGPT form in another was planned (and generated) twice.
    openai = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Name a prime."},
                    {"role": "assistant", "content": "7"},
                    {"role": "user", "content": "And another?"},
                ]
            }
        ],
    )
    sharegpt = write_jsonl(
        tmp_path / "b.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "Name a prime."},
                    {"from": "gpt", "value": "7"},
                    {"from": "human", "value": "And another?"},
                ]
            },
            {"conversations": [{"from": "human", "value": "Name a square."}]},
        ],
    )
    identity = PromptIdentity(Preparer(chat, True, 100_000))
    for ident in (identity, None):  # rendered ids (every run) and messages (no model at hand)
        items = list(iter_prompts([PromptSource(path=str(openai)), PromptSource(path=str(sharegpt))], identity=ident))
        prompts = [i for i in items if isinstance(i, Prompt)]
        (dup,) = [i for i in items if isinstance(i, Reject)]
        assert [(p.source, p.row) for p in prompts] == [("a", 0), ("b", 1)]
        assert dup.reason == "duplicate_prompt" and dup.source == "b" and dup.location == f"{sharegpt}:1"
        assert "same prompt as a row of source 'a', planned once under that source" in dup.detail, dup.detail
        # With a model the id is the content's (the same prompt, the same id); without, the label's.
        assert dup.prompt_id is not None and (dup.prompt_id == prompts[0].prompt_id) == (ident is not None)
