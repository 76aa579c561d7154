"""The tool-call parser (datagen/conversation/toolcalls.py) judged by SGLang 0.5.23's own `qwen3_coder` detector.

Each output of the corpus is parsed by both, with the same tools list; names and arguments must be equal
(SGLang returns arguments as JSON text: compared as the objects they decode to).
"""

from __future__ import annotations

import json
from typing import Any

from datagen.conversation.toolcalls import parse_tool_calls
from tests.conformance.conftest import RealSglang

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "lat": {"type": "number"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "unit": {"enum": ["c", "f"]},
                    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "free": {},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "no_params"}},
]


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CORPUS = [
    "No call here, just an answer.",
    call("get_weather", ("city", "Oslo"), ("days", "3")),
    "Let me check.\n\n" + call("get_weather", ("city", "New York"), ("metric", "True"), ("lat", "40.7")),
    call("search", ("q", "multi\nline\nquery")) + "\n" + call("get_weather", ("city", "Rome")),
    call("get_weather", ("opts", '{"hourly": true, "n": 2}'), ("tags", '["a", "b"]'), ("unit", "c")),
    call("get_weather", ("days", "three"), ("lat", "1e3"), ("lat", "12"), ("maybe", "null"), ("maybe", "7")),
    call("get_weather", ("opts", "{'py': 'dict'}"), ("free", "[1, 2]"), ("free", "not python")),
    call("get_weather", ("undeclared", "42"), ("city", "")),
    call("unknown_function", ("x", "1")),
    call("no_params", ("x", "1")),
    call("search"),
    "<tool_call>\n<function=search>\n<parameter=q>\ncut off",
    "<tool_call>\n<function=search>\n<parameter=q>\nunclosed parameter\n</function>\n</tool_call>",
    "text <tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>",
    "<tool_call>no function here</tool_call>",
    "<tool_call>\n<function=search\n</function>\n</tool_call>",
    call("get_weather", ("days", "-4"), ("lat", "-0.5"), ("metric", "yes")),
    call("search", ("q", "  spaced  ")),
    call("search", ("q", "\n\ndouble newlines\n\n")),
    call("search", ("q", "ünïcode ✓ 日本")),
]

_REAL = r"""
import json
from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector
tools = [Tool(**t) for t in json.loads(ARGS[0])]
out = []
for text in json.loads(ARGS[1]):
    res = Qwen3CoderDetector().detect_and_parse(text, tools)
    out.append([[c.name, json.loads(c.parameters)] for c in res.calls])
RESULT = out
"""


def test_parser_agrees_with_sglang_qwen3_coder_detector(real_sglang: RealSglang) -> None:
    real = real_sglang.run(_REAL, [json.dumps(TOOLS), json.dumps(CORPUS)])
    ours = [[[c.name, c.arguments] for c in parse_tool_calls(text, TOOLS)] for text in CORPUS]
    assert sum(1 for calls in real if calls) >= 12  # the corpus exercises calls, not only texts without one
    for text, mine, theirs in zip(CORPUS, ours, real, strict=True):
        assert mine == theirs, text


def test_without_tools_every_value_stays_text(real_sglang: RealSglang) -> None:
    texts = [call("get_weather", ("days", "3"), ("metric", "true")), call("search", ("q", "null"))]
    real = real_sglang.run(_REAL, ["[]", json.dumps(texts)])
    assert [[[c.name, c.arguments] for c in parse_tool_calls(t)] for t in texts] == real
