"""`datagen inspect NAMESPACE --conversation [ID]`: one published conversation, readable in a terminal.

Reads the namespace's `conversations/*.jsonl` (SpecForge's schema, datagen.conversation.export) through
`ObjectStore.iter_lines`, streaming, so the first conversation of a large file shows without downloading it.
Read tolerantly: `tools` and a call's `arguments` as JSON text or as objects, list content, an `outcome` at the
line's top level (every-turn mode: why the conversation ended) or none, keys it does not know ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from datagen.publishing.storage import ObjectStore

__all__ = ["FoundConversation", "find_conversation", "render_conversation"]

CONVERSATIONS_PREFIX = "conversations/"
REASONING_SHOWN = 400  # characters of reasoning shown: its start and its end
CONTENT_SHOWN = 2000


@dataclass(frozen=True, slots=True)
class FoundConversation:
    """A published conversation line and where it is."""

    record: dict[str, Any]
    key: str  # the object's key under the namespace
    line: int  # 1-based
    same_id: int = 1  # lines of the files with this id (a conversation published as several rows)


def _conversation_keys(store: ObjectStore, namespace: str) -> list[str]:
    prefix = f"{namespace}/{CONVERSATIONS_PREFIX}"
    return sorted(o.key for o in store.list(prefix) if o.key.endswith(".jsonl"))


def _lines(store: ObjectStore, keys: list[str]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    for key in keys:
        for lineno, raw in enumerate(store.iter_lines(key), 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a view shows what it can read: a broken line is not this command's to judge
            if isinstance(record, dict):
                yield key, lineno, record


def find_conversation(store: ObjectStore, namespace: str, conversation_id: str | None) -> FoundConversation | None:
    """The conversation with this id (the longest line when several carry it), or the first one; None: none."""
    ns = namespace.strip("/")
    keys = _conversation_keys(store, ns)
    found: FoundConversation | None = None
    for key, lineno, record in _lines(store, keys):
        short = key[len(ns) + 1 :]
        if conversation_id is None:
            return FoundConversation(record, short, lineno)
        if str(record.get("id")) != conversation_id:
            continue
        turns = len(record.get("conversations") or [])
        if found is None:
            found = FoundConversation(record, short, lineno)
        else:
            longer = turns > len(found.record.get("conversations") or [])
            kept = FoundConversation(record, short, lineno) if longer else found
            found = FoundConversation(kept.record, kept.key, kept.line, found.same_id + 1)
    return found


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's parts: the text ones joined, as the template joins them
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 3 // 4], text[-(limit // 4) :]
    return f"{head} […{len(text) - len(head) - len(tail):,} characters…] {tail}"


def _indent(text: str, prefix: str) -> list[str]:
    return [prefix + line for line in (text.splitlines() or [""])]


def _tools(raw: Any) -> list[str]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return ["(tools: not JSON)"]
    names = []
    for tool in raw if isinstance(raw, list) else []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        names.append(str(fn.get("name", "?")) if isinstance(fn, dict) else "?")
    return names


def _call(raw: Any) -> str:
    fn = raw.get("function", raw) if isinstance(raw, dict) else {}
    if not isinstance(fn, dict):
        return "?()"
    arguments = fn.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{fn.get('name', '?')}({_shorten(text, 300)})"


def render_conversation(found: FoundConversation) -> str:
    """The conversation for a terminal: each turn under its role, reasoning shortened, calls, the outcome."""
    record = found.record
    turns = [t for t in record.get("conversations") or [] if isinstance(t, dict)]
    roles = [str(t.get("role", "?")) for t in turns]
    outcome = record.get("outcome")
    lines = [
        f"conversation {record.get('id')}  ({found.key} line {found.line})",
        f"outcome: {outcome}" if outcome is not None else "outcome: not recorded (a `last` mode conversation)",
        f"turns: {roles.count('user')} user, {roles.count('assistant')} assistant, {roles.count('tool')} tool",
    ]
    if found.same_id > 1:
        lines.append(f"{found.same_id} lines carry this id: the one with the most turns is shown")
    if record.get("tools") is not None:
        lines.append("tools: " + ", ".join(_tools(record["tools"])))
    for turn in turns:
        role = str(turn.get("role", "?"))
        label = role.upper() + (f" ({turn['name']})" if turn.get("name") else "")
        lines += ["", f"── {label}"]
        reasoning = turn.get("reasoning_content")
        content = _text(turn.get("content")).strip()  # the template trims it too
        calls = turn.get("tool_calls") or []
        if isinstance(reasoning, str):
            lines.append(f"  reasoning ({len(reasoning):,} characters):")
            lines += _indent(_shorten(reasoning.strip(), REASONING_SHOWN), "  │ ")
            if content or not calls:
                lines.append("  answer:" if content else "  answer: (none)")
        if content:
            lines += _indent(_shorten(content, CONTENT_SHOWN), "  ")
        for call in calls:
            lines.append(f"  → calls {_call(call)}")
    return "\n".join(lines)
