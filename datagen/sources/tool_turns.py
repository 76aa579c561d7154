"""Tool-calling conversations as rows hold them: tools lists, assistant tool calls and tool turns, loaded as Messages.

The loader (datagen.sources.prompts) reads a row's turns; this module turns the tool parts into what the chat template
reads, or refuses them with a load reject that says what and where:

- OpenAI: `{"messages": [..., {"role": "assistant", "content": ..., "tool_calls": [{"type": "function",
  "function": {"name", "arguments"}, "id"}]}, {"role": "tool", "tool_call_id", "content"}], "tools": [...]}`;
  `reasoning_content` on an assistant turn is kept (the template renders it, not a `<think>` block in content).
- ShareGPT: `{"conversations": [..., {"from": "function_call", "value": "{\"name\": ..., \"arguments\": ...}"},
  {"from": "observation", "value": "..."}], "tools": "[...]"}` (LLaMA-Factory's form: values and tools may be
  JSON text). A call turn right after an assistant turn is that turn's call (one assistant message).
- `tools`: a list of OpenAI function schemas (`{"type": "function", "function": {"name", ...}}` or the bare
  `{"name", ...}`), kept as given: the template renders each with `tojson`. A source's `tools` apply to rows
  that declare none.

Arguments given as JSON text are parsed to an object: the Qwen3.6 template renders only an object's items as
`<parameter=...>` blocks, so text arguments would reach the model as a call without parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from datagen.records import Message, Role, ToolCall
from datagen.sources.preparation import Unsendable

__all__ = ["CALL_SPEAKERS", "RESULT_SPEAKERS", "TOOL_REJECT_REASONS", "close_calls", "row_tools", "turn_message"]

# ShareGPT / OpenAI speaker names of a turn that is the assistant calling functions, and of a tool's result.
CALL_SPEAKERS = frozenset({"function_call", "tool_call"})
RESULT_SPEAKERS = frozenset({"tool", "function", "function_response", "tool_response", "observation", "ipython"})

# The load reject reasons this module gives (listed with the loader's in LOAD_REJECT_REASONS).
TOOL_REJECT_REASONS = frozenset({"bad_tools", "bad_tool_call", "bad_tool_turn"})

TextOf = Callable[[Any, str], str]


def row_tools(row: dict[str, Any], source_tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools a row declares (its `tools`, else its source's); None when neither declares any."""
    raw = row.get("tools")
    if raw is None or raw == "" or raw == []:
        return check_tools(list(source_tools), "source tools") if source_tools else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise Unsendable("bad_tools", f"'tools' is text that is not JSON: {exc.msg} (column {exc.colno})") from exc
    return check_tools(raw, "tools")


def check_tools(tools: Any, label: str) -> list[dict[str, Any]]:
    """`tools` when it is a list of function schemas each naming its function; raises Unsendable (bad_tools)."""
    if not isinstance(tools, list):
        raise Unsendable("bad_tools", f"{label!r} must be a list of function schemas, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise Unsendable("bad_tools", f"{label}[{i}] must be an object, got {type(tool).__name__}")
        fn = tool.get("function", tool)
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise Unsendable("bad_tools", f"{label}[{i}] is not a function schema (type {tool.get('type')!r})")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise Unsendable("bad_tools", f"{label}[{i}] has no function name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise Unsendable("bad_tools", f"{label}[{i}].parameters must be an object, got {type(params).__name__}")
    return tools


def turn_message(role: Role, content: Any, label: str, raw: dict[str, Any], speaker: str, text_of: TextOf) -> Message:
    """One turn as a Message: its text (by the loader's `text_of`) plus reasoning, tool calls, call id and name."""
    if speaker in CALL_SPEAKERS:
        return Message(role="assistant", content="", tool_calls=_sharegpt_calls(content, label))
    if role == "tool":
        text = text_of(content, label)
        call_id, name = raw.get("tool_call_id"), raw.get("name")
        if call_id is not None and not isinstance(call_id, str):
            raise Unsendable("bad_tool_turn", f"{label}: tool_call_id must be a string, got {type(call_id).__name__}")
        if name is not None and not isinstance(name, str):
            raise Unsendable("bad_tool_turn", f"{label}: name must be a string, got {type(name).__name__}")
        return Message(role="tool", content=text, tool_call_id=call_id, name=name)
    if role != "assistant":
        return Message(role=role, content=text_of(content, label))
    calls = _openai_calls(raw, label)
    reasoning = raw.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise Unsendable("wrong_type", f"{label}: reasoning_content must be a string, got {type(reasoning).__name__}")
    # A turn that only calls functions often has null content (OpenAI writes it so).
    text = "" if calls and content is None else text_of(content, label)
    if calls is None and "<tool_call>" in text:
        text, calls = _content_calls(text, label)
    return Message(role="assistant", content=text, reasoning_content=reasoning, tool_calls=calls)


_JSON_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})?\s*</tool_call>|<tool_call>\s*\{", re.DOTALL)


def _content_calls(text: str, label: str) -> tuple[str, tuple[ToolCall, ...] | None]:
    """Qwen2.5-style calls recorded in an assistant's content (`<tool_call>{"name", "arguments"}</tool_call>`).

    Returns the content without them and the calls; raises Unsendable (bad_tool_call) naming a call that is not a
    JSON object with a name. Content with no such block (e.g. Qwen3's `<function=...>` form) is left as it is.
    """
    calls: list[ToolCall] = []
    for i, match in enumerate(_JSON_CALL_RE.finditer(text)):
        where = f"{label} <tool_call> {i}"
        body = match.group(1)
        if body is None:
            raise Unsendable("bad_tool_call", f"{where}: not a JSON call closed by </tool_call>")
        try:
            raw = json.loads(body)
        except json.JSONDecodeError as exc:
            raise Unsendable("bad_tool_call", f"{where}: the call is not JSON: {exc.msg} (column {exc.colno})") from exc
        calls.append(_call(raw, where))
    if not calls:
        return text, None
    return _JSON_CALL_RE.sub("", text).strip(), tuple(calls)


def close_calls(messages: list[Message], labels: list[str]) -> list[Message]:
    """Messages with each call-only assistant turn joined to the assistant turn right before it; tool order checked.

    A tool turn must answer a call: an assistant turn with tool calls (or another tool turn) comes right before.
    """
    out: list[Message] = []
    for message, label in zip(messages, labels, strict=True):
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.role == "assistant"
            and message.role == "assistant"
            and message.tool_calls
            and not message.text
            and message.reasoning_content is None
        ):
            calls = (*(prev.tool_calls or ()), *message.tool_calls)
            out[-1] = Message(
                role="assistant", content=prev.content, reasoning_content=prev.reasoning_content, tool_calls=calls
            )
            continue
        if message.role == "tool" and not (
            prev is not None and (prev.role == "tool" or (prev.role == "assistant" and prev.tool_calls))
        ):
            raise Unsendable("bad_tool_turn", f"{label}: a tool result that follows no assistant tool call")
        out.append(message)
    return out


def _openai_calls(raw: dict[str, Any], label: str) -> tuple[ToolCall, ...] | None:
    calls = raw.get("tool_calls")
    if calls is None and isinstance(raw.get("function_call"), dict):
        calls = [{"function": raw["function_call"]}]  # OpenAI's older single-call field
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise Unsendable("bad_tool_call", f"{label}: tool_calls must be a list, got {type(calls).__name__}")
    return tuple(_call(c, f"{label} tool_calls[{i}]") for i, c in enumerate(calls))


def _sharegpt_calls(value: Any, label: str) -> tuple[ToolCall, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            detail = f"{label}: function call is not JSON: {exc.msg} (column {exc.colno})"
            raise Unsendable("bad_tool_call", detail) from exc
    items = value if isinstance(value, list) else [value]
    if not items:
        raise Unsendable("bad_tool_call", f"{label}: function call turn holds no call")
    return tuple(_call(c, f"{label}[{i}]" if isinstance(value, list) else label) for i, c in enumerate(items))


def _call(raw: Any, label: str) -> ToolCall:
    if not isinstance(raw, dict):
        raise Unsendable("bad_tool_call", f"{label} must be an object, got {type(raw).__name__}")
    fn = raw.get("function", raw)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise Unsendable("bad_tool_call", f"{label} has no function name")
    arguments = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise Unsendable(
                "bad_tool_call", f"{label}: arguments are not JSON: {exc.msg} (column {exc.colno})"
            ) from exc
    if not isinstance(arguments, dict):
        raise Unsendable("bad_tool_call", f"{label}: arguments must be an object, got {type(arguments).__name__}")
    call_id = raw.get("id")
    return ToolCall(name=fn["name"], arguments=arguments, id=call_id if isinstance(call_id, str) else None)
