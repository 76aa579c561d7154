"""The tool-call parser on the model's format, and a Completion's calls through its checkpoint line."""

from __future__ import annotations

from datagen.conversation.toolcalls import answer_text, parse_tool_calls
from datagen.records import Completion, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def test_a_call_in_the_models_format_parses_to_typed_arguments() -> None:
    assert parse_tool_calls("Checking.\n\n" + CALL, TOOLS) == [ToolCall("get_weather", {"city": "Oslo", "days": 2})]
    assert parse_tool_calls(CALL) == [ToolCall("get_weather", {"city": "Oslo", "days": "2"})]  # undeclared: text
    assert parse_tool_calls("no call") == []


def test_two_calls_keep_their_order_and_reasoning_is_not_parsed() -> None:
    second = CALL.replace("Oslo", "Rome")
    text = "thinking about <tool_call>\n<function=nope>\n</function>\n</tool_call>\n</think>\n\n" + CALL + "\n" + second
    calls = parse_tool_calls(answer_text(text), TOOLS)
    assert [c.arguments["city"] for c in calls] == ["Oslo", "Rome"]


def test_template_renders_parsed_calls_back_to_the_same_text() -> None:
    """What the template writes for a recorded call (datagen/local/model_fixture.py's Qwen3.6 template) parses back."""
    from datagen.chat import ChatTokenizer
    from datagen.local.model_fixture import ensure_model_dir

    chat = ChatTokenizer.shared(ensure_model_dir())
    (parsed,) = parse_tool_calls(CALL, TOOLS)
    text = chat.render_conversation(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [parsed.to_dict()]}],
        tools=TOOLS,
    )
    assert CALL in text


def test_completion_tool_calls_round_trip_in_the_checkpoint_line() -> None:
    base = dict(
        prompt_id="p",
        source="s",
        row=0,
        messages=[{"role": "user", "content": "q"}],
        request_key="k",
        prompt_tokens=3,
        output_ids=[1, 2],
        text="x",
        finish_reason="stop",
        completion_tokens=2,
    )
    plain = Completion(**base)  # type: ignore[arg-type]
    assert "tool_calls" not in plain.to_json() and "tools" not in plain.to_json()
    with_calls = Completion(**base, tools=TOOLS, tool_calls=[ToolCall("get_weather", {"city": "Oslo"})])  # type: ignore[arg-type]
    back = Completion.from_json(with_calls.to_json())
    assert back == with_calls and back.tool_calls == [ToolCall("get_weather", {"city": "Oslo"})]
