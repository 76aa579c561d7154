"""The model's own tool calls, parsed from its answer text in Qwen3.6's format into `ToolCall` records.

Qwen3.6 writes a call as
    <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>
(the chat template renders recorded calls the same way). Parsing follows SGLang 0.5.23's `qwen3_coder`
detector (`Qwen3CoderDetector.detect_and_parse`), which is what a server answering with `--tool-call-parser
qwen3_coder` would return: parameter values are text, converted by the declared parameter's JSON-schema type
(integer, number, boolean, object/array; `null` is None; a parameter not declared stays text). The
conformance tier (tests/conformance/test_toolcall_conformance.py) judges this module against the real
detector on a corpus of outputs. Only the answer is parsed: reasoning before `</think>` is not an answer.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from datagen.records import ToolCall

__all__ = ["answer_text", "parse_tool_calls"]

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION_RE = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def answer_text(text: str) -> str:
    """The answer part of a thinking-format output: what follows the last `</think>` (all of it without one)."""
    return text.rsplit("</think>", 1)[-1]


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ToolCall]:
    """The calls written in `text` (an answer, not its reasoning), in order; [] when there are none."""
    if "<tool_call>" not in text:
        return []
    blocks = _CALL_RE.findall(text)
    if not blocks and "<function=" in text:
        blocks = [text]  # an unclosed call: SGLang reads the whole text as its body
    calls: list[ToolCall] = []
    for block in blocks:
        for closed, unclosed in _FUNCTION_RE.findall(block):
            body = closed or unclosed
            if ">" not in body:
                continue
            name, params = body.split(">", 1)
            schema = _parameters(name, tools)
            arguments: dict[str, Any] = {}
            for match in _PARAMETER_RE.findall(params):
                if ">" not in match:
                    continue
                key, value = match.split(">", 1)
                value = value.removeprefix("\n").removesuffix("\n")
                arguments[key] = _convert(value, schema.get(key), key in schema)
            calls.append(ToolCall(name=name, arguments=arguments))
    return calls


def _parameters(name: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The declared parameters of function `name` (its schema's properties); {} when not declared."""
    for tool in tools or ():
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping) or fn.get("name") != name:
            continue
        params = fn.get("parameters")
        if not isinstance(params, dict):
            return {}
        props = _properties(params)
        return props if props or "properties" in params else params
    return {}


def _properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    props = schema.get("properties")
    if isinstance(props, dict):
        return props
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in _properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def _schema_type(schema: Any) -> str | None:
    """The primary type a JSON schema declares (SGLang's `infer_type_from_json_schema`)."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        value = schema["type"]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            non_null = [t for t in value if t != "null"]
            return non_null[0] if non_null else "string"
    if "anyOf" in schema or "oneOf" in schema:
        branches = schema.get("anyOf") or schema.get("oneOf")
        types = [t for b in branches if (t := _schema_type(b))] if isinstance(branches, list) else []
        if types:
            if len(set(types)) == 1:
                return types[0]
            if len(set(types)) == 2 and "null" in types:
                return next(t for t in types if t != "null")
            return "string" if "string" in types else types[0]
    if isinstance(schema.get("enum"), list):
        kinds = {_enum_kind(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            found = _schema_type(branch)
            if found and found != "string":
                return found
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _enum_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _convert(value: str, schema: Any, declared: bool) -> Any:
    """A parameter's text as its declared type; text where it does not convert (as SGLang degrades)."""
    if value.lower() == "null":
        return None
    if not declared:
        return value
    kind = str(_schema_type(schema) or "string").strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if "." not in value and "e" not in value.lower() and number.is_integer():
            return int(number)
        return number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=SyntaxWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
