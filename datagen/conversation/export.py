"""Conversations in SpecForge's JSONL schema, written beside the token rows and published with them.

One line per training row: `{"id", "conversations": [{role, content, reasoning_content?, tool_calls?,
tool_call_id?, name?}], "tools"?}`: the prompt's messages, then the regenerated assistant turn with its
reasoning split from its answer the way SGLang's qwen3 reasoning parser splits it (before `</think>`, after).
`id` is the token row's `conversation_id`, so a trainer's rows and ours can be joined.

Two fields are JSON strings rather than nested JSON, because the trainers load this file with `datasets`
(Arrow), whose JSON reader unifies objects across lines into one struct type: each row's tool schemas would
come back with every other row's parameters as nulls, which the chat template then renders. SpecForge
(`build_eagle3_dataset`, `Parser._sanitize_message`) and speculators (`_parse_conv_tools`) both parse
these strings back: `tools` is the JSON text of the list, a tool call's `function.arguments` the JSON text
of its object (OpenAI's own form). List content is written as its text (what the template renders), so
`content` is a string on every line for the same reason.

Files: `conversations/conversations-00000-of-0000N.jsonl`, the same rows per file as `data/train-*.parquet`,
in the same order; the bytes depend only on the rows (no timestamps), so a re-run writes identical files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from datagen.records import Completion, Message, ToolCall

__all__ = [
    "CONVERSATIONS_DIR",
    "CONVERSATIONS_GLOB",
    "ConversationWriter",
    "assistant_turn",
    "assistant_view",
    "conversation_record",
    "split_reasoning",
]

CONVERSATIONS_DIR = "conversations"
CONVERSATIONS_GLOB = f"{CONVERSATIONS_DIR}/conversations-*.jsonl"
THINK_START = "<think>"
THINK_END = "</think>"
# SGLang's Qwen3Detector treats an opening tool call as the end of reasoning when `</think>` never came.
TOOL_CALL_START = "<tool_call>"


def split_reasoning(text: str, enable_thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated turn, as SGLang 0.5.23's Qwen3Detector.detect_and_parse splits it.

    Thinking on, the generation prompt opened `<think>`, so the text is reasoning up to `</think>` and the
    answer after it (neither stripped); without `</think>` it is all reasoning (truncated), unless a
    `<tool_call>` interrupts it. Thinking off and no `<think>` in the text: no reasoning, all answer.
    """
    if not enable_thinking and THINK_START not in text:
        return None, text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    if THINK_END in body:
        reasoning, answer = body.split(THINK_END, 1)
        return reasoning, answer
    tool = body.find(TOOL_CALL_START)
    if tool != -1:
        return body[:tool], body[tool:]
    return body, ""


def _call_json(call: ToolCall) -> dict[str, Any]:
    out = call.to_dict()
    arguments = call.arguments
    out["function"]["arguments"] = (
        arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    )
    return out


def _message_json(m: Message) -> dict[str, Any]:
    out = m.to_dict()
    out["content"] = m.text
    if m.tool_calls is not None:
        out["tool_calls"] = [_call_json(c) for c in m.tool_calls]
    return out


def assistant_turn(c: Completion, enable_thinking: bool, step: int | None = None) -> Message:
    """The generated turn as a message: reasoning, answer, and the calls parsed from it (their markup left out).

    Each call gets an OpenAI id when it has none: `call_<step>_<i>` (`step`: the step it is, default the line's),
    unique in its conversation; where recorded results follow, the engine gives it the recorded one
    (datagen.conversation.regeneration.paired_calls).
    """
    reasoning, answer = split_reasoning(c.text, enable_thinking)
    step = step if step is not None else c.step
    calls = (
        tuple(
            call if call.id is not None else replace(call, id=f"call_{step}_{i}") for i, call in enumerate(c.tool_calls)
        )
        if c.tool_calls
        else None
    )
    if calls is not None and TOOL_CALL_START in answer:
        # As SGLang's tool parsers return it: the visible text before the first call.
        answer = answer[: answer.index(TOOL_CALL_START)]
    return Message(role="assistant", content=answer, reasoning_content=reasoning, tool_calls=calls)


def assistant_view(m: Message) -> tuple[str, str | None, list[tuple[str, Any]]]:
    """What the template renders of an assistant turn: text, reasoning, calls (ids are the engine's business)."""
    calls = [(c.name, c.arguments) for c in m.tool_calls or ()]
    return m.text, m.reasoning_content, calls


def conversation_record(
    steps: Sequence[Completion], enable_thinking: bool, outcome: str | None = None
) -> dict[str, Any]:
    """A conversation as one published line, in SpecForge's schema: its last kept step's history plus that step's
    generated turn (a conversation of one step: the prompt's messages plus the regenerated turn).

    That history already holds every earlier kept step as an assistant turn (content, reasoning, calls) with the
    recorded tool turns spliced between them, and the system and user turns (tokenization checks it against the
    steps). `outcome` (why the conversation ended, docs/conversations.md) is a key SpecForge and speculators do
    not read; omitted when unknown (a conversation whose next step generation rejected: its reject row says why)
    and where the mode publishes none (`turns: last`).
    """
    c = steps[-1]
    record: dict[str, Any] = {
        "id": c.prompt_id,
        "conversations": [_message_json(m) for m in [*c.messages, assistant_turn(c, enable_thinking)]],
    }
    if c.tools is not None:
        record["tools"] = json.dumps(c.tools, ensure_ascii=False)
    # Where it came from (issue 47): the source row's place ("file:line") and its own id.
    if c.location is not None:
        record["location"] = c.location
    if c.source_id is not None:
        record["source_id"] = c.source_id
    if outcome is not None:
        record["outcome"] = outcome
    return record


class ConversationWriter:
    """Writes conversation lines into numbered part files, then names them `-of-N` like the data files."""

    def __init__(self, staging_dir: Path, rows_per_file: int) -> None:
        if rows_per_file < 1:
            raise ValueError("rows_per_file must be >= 1")
        self._dir = Path(staging_dir) / CONVERSATIONS_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        # A previous attempt's files would be published alongside this one's: remove them first.
        for stale in self._dir.glob("conversations-*.jsonl"):
            stale.unlink()
        self._tmp = self._dir / ".parts"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._rows_per_file = rows_per_file
        self._file: TextIO | None = None
        self._in_file = 0
        self._parts: list[Path] = []
        self.rows = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None or self._in_file >= self._rows_per_file:
            self._open()
        assert self._file is not None
        self._file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._in_file += 1
        self.rows += 1

    def _open(self) -> None:
        if self._file is not None:
            self._file.close()
        path = self._tmp / f"part-{len(self._parts):05d}.jsonl"
        self._parts.append(path)
        self._file = path.open("w", encoding="utf-8")
        self._in_file = 0

    def close(self) -> list[Path]:
        """Final names (an empty dataset is one empty file, as the data side has one empty parquet)."""
        if self._file is None:
            self._open()
        assert self._file is not None
        self._file.close()
        n = len(self._parts)
        final = [self._dir / f"conversations-{i:05d}-of-{n:05d}.jsonl" for i in range(n)]
        for src, dst in zip(self._parts, final, strict=True):
            src.replace(dst)
        self._tmp.rmdir()
        return final
