"""The stand-in answers a prompt that declares tools with a call in the model's format (its knobs), over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.toolcalls import answer_text, parse_tool_calls
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import ToolCall
from datagen.standin.knobs import KnobError, Knobs
from datagen.standin.testing import run_standin

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]
QUESTIONS = [f"What is the weather in city number {i}?" for i in range(12)]


def _outputs(tmp_path: Path, env: dict[str, str], tools: list[dict[str, object]] | None) -> list[tuple[str, list[int]]]:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.shared(model_dir)
    env = {"DATAGEN_STANDIN_LOAD_S": "0", **env}
    out = []
    with run_standin(model_dir, args=["--skip-server-warmup"], env=env, log_path=tmp_path / "s.log") as ep:
        headers = {"Authorization": f"Bearer {ep.api_key.get_secret_value()}"}
        with httpx.Client(base_url=ep.url, headers=headers, timeout=60) as c:
            for q in QUESTIONS:
                ids = chat.prompt_ids([{"role": "user", "content": q}], True, tools)
                r = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4000}})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["output_ids"][-1] == IM_END_ID
                assert chat.encode(body["text"]) == body["output_ids"][:-1], "text must re-encode to the same ids"
                out.append((body["text"], body["output_ids"]))
    return out


def test_some_answers_call_the_first_declared_function_with_typed_values(tmp_path: Path) -> None:
    outputs = _outputs(tmp_path, {"DATAGEN_STANDIN_TOOL_CALL_RATE": "0.5"}, TOOLS)
    calls = [parse_tool_calls(answer_text(text), TOOLS) for text, _ in outputs]
    made = [c for c in calls if c]
    assert 0 < len(made) < len(QUESTIONS)  # "sometimes": both kinds of answer at rate 0.5 over 12 prompts
    assert all(c == [ToolCall("get_weather", {"city": "example", "days": 3, "metric": True})] for c in made)
    assert all("</think>" in text for text, _ in outputs)


def test_rate_one_without_match_calls_an_undeclared_function(tmp_path: Path) -> None:
    env = {"DATAGEN_STANDIN_TOOL_CALL_RATE": "1", "DATAGEN_STANDIN_TOOL_CALL_MATCH": "0"}
    outputs = _outputs(tmp_path, env, TOOLS)
    assert all(parse_tool_calls(answer_text(t), TOOLS) == [ToolCall("undeclared_function", {})] for t, _ in outputs)


def test_a_prompt_without_tools_never_gets_a_call(tmp_path: Path) -> None:
    outputs = _outputs(tmp_path, {"DATAGEN_STANDIN_TOOL_CALL_RATE": "1"}, None)
    assert all("<tool_call>" not in text for text, _ in outputs)


def test_tool_call_knobs_are_checked() -> None:
    assert Knobs.from_env({}).tool_call_rate == 0.5 and Knobs.from_env({}).tool_call_match is True
    assert Knobs.from_env({"DATAGEN_STANDIN_TOOL_CALL_MATCH": "0"}).tool_call_match is False
    for bad in ({"DATAGEN_STANDIN_TOOL_CALL_MATCH": "maybe"}, {"DATAGEN_STANDIN_TOOL_CALL_RATE": "1.5"}):
        with pytest.raises(KnobError, match="TOOL_CALL"):
            Knobs.from_env(bad)
