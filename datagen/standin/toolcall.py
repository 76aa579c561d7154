"""The stand-in's tool calls: when a prompt declares tools, an answer may be a call in Qwen3.6's format.

The tools are read from the prompt as the model reads them: the template's `# Tools` system block, one JSON
function schema a line between `<tools>` and `</tools>`. The call is written exactly as the template renders
a recorded call, so datagen.conversation.toolcalls (and SGLang's qwen3_coder parser) read it back.
"""

from __future__ import annotations

import json
from typing import Any

from datagen.chat import IM_START_ID, ChatTokenizer

__all__ = ["call_text", "declared_tools"]

_TOOLS_HEADER = "<|im_start|>system\n# Tools"
_HEADER_TOKENS = 8  # "<|im_start|>system\n# Tools" is fewer tokens than this
# A value of each JSON-schema type that the type's parser conversion reads back (datagen.conversation.toolcalls).
_EXAMPLES = {"integer": "3", "number": "2.5", "boolean": "true", "object": '{"key": "value"}', "array": '["a", "b"]'}
UNDECLARED = "undeclared_function"


def declared_tools(tokenizer: ChatTokenizer, prompt_ids: list[int]) -> list[dict[str, Any]]:
    """The function schemas the prompt's tools block declares, in order; [] when it declares none."""
    if not prompt_ids or prompt_ids[0] != IM_START_ID:
        return []
    if not tokenizer.decode(prompt_ids[:_HEADER_TOKENS]).startswith(_TOOLS_HEADER):
        return []
    text = tokenizer.decode(prompt_ids)
    start, end = text.find("<tools>\n"), text.find("\n</tools>")
    if start < 0 or end < start:
        return []
    tools: list[dict[str, Any]] = []
    for line in text[start + len("<tools>\n") : end].split("\n"):
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools


def call_text(tools: list[dict[str, Any]], match: bool) -> str:
    """A call of the first declared function with a value for each declared parameter (`match`), else of a
    function the prompt does not declare."""
    fn = tools[0].get("function", tools[0]) if tools else {}
    if not match or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return f"<tool_call>\n<function={UNDECLARED}>\n</function>\n</tool_call>"
    params = fn.get("parameters")
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    body = ""
    for name, schema in props.items() if isinstance(props, dict) else ():
        kind = schema.get("type") if isinstance(schema, dict) else None
        value = _EXAMPLES.get(kind, "example") if isinstance(kind, str) else "example"
        body += f"<parameter={name}>\n{value}\n</parameter>\n"
    return f"<tool_call>\n<function={fn['name']}>\n{body}</function>\n</tool_call>"
