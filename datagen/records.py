"""The data path's records, one type per hop, each beside its Arrow schema.

prompts -> requests -> completions -> verdicts -> token rows -> published objects.
Records cross process boundaries as JSON lines (checkpoints) or parquet (datasets); flows
pass only references (URIs, counts, checksums) to them.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import pyarrow as pa

__all__ = [
    "COMPLETION_SCHEMA",
    "REJECT_SCHEMA",
    "STEP_KEY_SEPARATOR",
    "TOKEN_ROW_SCHEMA",
    "Completion",
    "ContentPart",
    "Message",
    "Prompt",
    "Reject",
    "RejectStage",
    "Role",
    "TokenRow",
    "ToolCall",
    "split_step_key",
]

RejectStage = Literal["load", "generate", "validate", "tokenize"]
Role = Literal["system", "user", "assistant", "tool"]
_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
# One part of list content, as OpenAI writes it: {"type": "text", "text": ...}, {"type": "image_url", ...}.
ContentPart = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call an assistant turn makes (OpenAI's `tool_calls[i]`); arguments as the row gives them."""

    name: str
    arguments: dict[str, Any] | str  # the Qwen templates render a dict's items; OpenAI rows carry a JSON string
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's shape, which the chat templates read (`tool_call.function.name`)."""
        out: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            out["id"] = self.id
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ToolCall:
        """From OpenAI's shape (`{"function": {"name", "arguments"}}`) or a flat `{"name", "arguments"}`."""
        fn = raw.get("function", raw)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool call without a function name: {raw!r}")
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, dict | str):
            raise ValueError(f"tool call {fn['name']!r}: arguments must be an object or a JSON string")
        call_id = raw.get("id")
        return cls(name=fn["name"], arguments=arguments, id=call_id if isinstance(call_id, str) else None)


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation, in the shape chat templates and trainers read (OpenAI's, plus reasoning).

    Serialized with only the fields that are set, so a plain turn stays `{"role": ..., "content": ...}`: prompt
    and checkpoint files written before this type existed read back unchanged, and write back byte for byte.
    """

    role: Role
    content: str | list[ContentPart]
    reasoning_content: str | None = None  # an assistant turn's thinking (SpecForge's and the Qwen templates' key)
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None  # a tool turn: the function that answered

    @property
    def text(self) -> str:
        """The content as text: list content's text parts joined as the chat templates join them (no separator)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content if p.get("type", "text") == "text" and "text" in p)

    def to_dict(self) -> dict[str, Any]:
        """The JSON / chat-template form: role and content, then each optional field only when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls is not None:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Message:
        """The inverse of to_dict (also reads the `{"role", "content"}` dicts older files hold)."""
        role = raw.get("role")
        if role not in _ROLES:
            raise ValueError(f"message role must be one of {sorted(_ROLES)}, got {role!r}")
        content = raw.get("content")
        if not isinstance(content, str | list):
            raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
        calls = raw.get("tool_calls")
        return cls(
            role=role,
            content=content,
            reasoning_content=raw.get("reasoning_content"),
            tool_calls=tuple(ToolCall.from_dict(c) for c in calls) if calls is not None else None,
            tool_call_id=raw.get("tool_call_id"),
            name=raw.get("name"),
        )


def _messages_in(items: list[Any]) -> list[Message]:
    """Messages from what a record was built or loaded with: Message objects or their dict form."""
    return [m if isinstance(m, Message) else Message.from_dict(m) for m in items]


STEP_KEY_SEPARATOR = ":step-"  # a step's request key: the conversation's request key + ":step-N"


def split_step_key(key: str) -> tuple[str, int] | None:
    """(conversation key, step) of a step's request key; None for a key that names no step (the conversation's own:
    its one step is the recorded conversation's last reply, `turns: last`)."""
    base, sep, n = key.rpartition(STEP_KEY_SEPARATOR)
    return (base, int(n)) if sep and n.isdigit() else None


# A line whose request key names no step is its conversation's one step: its step and user turn are implied (0 and
# 0: the recorded history is its prompt) and never written, so such lines read and write byte for byte as before.
_IMPLIED_STEP_FIELDS = frozenset({"step", "turn_index"})
# Fields added after checkpoints and prompt files existed: written only when set, so a line without them reads
# (and hashes, e.g. a plan's sha256) byte for byte as before they existed.
_OMITTED_WHEN_UNSET = frozenset({"normalized", "tools", "tool_calls", "bridge_ids", "outcome", "source_id"})


def _record_json(record: Any, skip: frozenset[str] = frozenset()) -> str:
    """A record with messages as one JSON line: messages in their dict form, fields in declaration order."""
    if isinstance(record, Completion) and split_step_key(record.request_key) is None:
        skip = skip | _IMPLIED_STEP_FIELDS
    body = {
        f.name: getattr(record, f.name)
        for f in fields(record)
        if f.name not in skip and not (f.name in _OMITTED_WHEN_UNSET and getattr(record, f.name) is None)
    }
    body["messages"] = [m.to_dict() for m in body["messages"]]
    if body.get("tool_calls") is not None:
        body["tool_calls"] = [c.to_dict() for c in body["tool_calls"]]
    return json.dumps(body, ensure_ascii=False)


@dataclass(slots=True)
class Prompt:
    """A conversation to complete: every turn up to (not including) the assistant reply we generate."""

    prompt_id: str
    source: str
    row: int  # 0-based row index in its source (rejected rows counted), for lineage; see `location`
    messages: list[Message]
    category: str | None = None
    # Where the row is, to find it by hand: "file:line" (1-based, blank lines counted) for JSON lines and
    # JSON lists, "file:row N" for parquet, "dataset[split]:row N" for `datasets` rows (N 0-based).
    location: str | None = None
    # The Unicode normalization applied at load so the messages are what the tokenizer makes of them ("NFC");
    # None when the text was already so. Carried to the completion and the training row.
    normalized: str | None = None
    # The rendered prompt's token ids when the loader rendered it (for its id): held in memory only, never in
    # the JSON line; planning writes them beside the shard (datagen.sources.preparation) so generation need not render.
    input_ids: array[int] | None = field(default=None, repr=False, compare=False)
    # The functions the conversation may call (OpenAI function schemas, as the row or its source gives them):
    # passed to the chat template as `tools=` wherever the prompt is rendered. None: the row declares none.
    tools: list[dict[str, Any]] | None = None
    # The row's own id in its source (its `id` field, as text), to trace a published row back to it; None: none.
    source_id: str | None = None
    # The prompt's id in the other id scheme (datagen.identity: the legacy id of a run under the content scheme),
    # held in memory only: planning matches both against the catalog of published prompts.
    alias: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.messages = _messages_in(self.messages)

    def to_json(self) -> str:
        return _record_json(self, skip=frozenset({"input_ids", "alias"}))

    @classmethod
    def from_json(cls, line: str) -> Prompt:
        return cls(**json.loads(line))


@dataclass(slots=True)
class Reject:
    """A sample that will not ship, and why. Nothing is dropped without one of these."""

    stage: RejectStage
    reason: str  # short machine-readable code, e.g. "malformed_row", "prompt_too_long", "truncated"
    detail: str  # human-readable: what and where
    source: str
    row: int | None = None
    prompt_id: str | None = None
    completion_tokens: int | None = None
    request_key: str | None = None  # generation stage: content key, so a rerun knows this request is settled
    location: str | None = None  # the input row: "file:line", "file:row N" or "dataset[split]:row N" (see Prompt)
    source_id: str | None = None  # the input row's own id (see Prompt.source_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Reject:
        return cls(**json.loads(line))


REJECT_SCHEMA = pa.schema(
    [
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("row", pa.int64()),
        pa.field("prompt_id", pa.string()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("request_key", pa.string()),
        pa.field("location", pa.string()),
        pa.field("source_id", pa.string()),  # added with issue 47: older files read with it as nulls
    ]
)


@dataclass(slots=True)
class Completion:
    """What a server generated for one prompt, exactly as returned (token ids included)."""

    prompt_id: str
    source: str
    row: int
    messages: list[Message]
    request_key: str  # content key: prompt id + sampling + model fingerprint + template hash
    prompt_tokens: int
    output_ids: list[int]  # as returned by /generate, ending with the stop token when finished by EOS
    text: str  # server's decoded text (excludes the matched EOS)
    finish_reason: str  # "stop" | "length" | "abort"
    completion_tokens: int
    server: str = ""
    latency_s: float = 0.0
    category: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    location: str | None = None  # the input row (see Prompt.location)
    normalized: str | None = None  # see Prompt.normalized
    tools: list[dict[str, Any]] | None = None  # the prompt's tools (see Prompt.tools): its render needs them
    # The calls the model made in its answer (datagen.conversation.toolcalls parses them from `text`); None: it
    # made none.
    tool_calls: list[ToolCall] | None = None
    # Where this generation sits in its conversation (docs/conversations.md). A line whose request key names no step
    # (`turns: last`) is the conversation's one step, 0 of its one generated turn 0 (the recorded history is the
    # prompt); these two are written only in a step's line (`_IMPLIED_STEP_FIELDS`).
    step: int = 0  # 0-based index of this generation within the conversation
    turn_index: int = 0  # 0-based user turn this step answers
    # A step continuing its user turn after tool results: the ids sent between the previous step's output_ids
    # and this generation (tool turns + generation prompt). None on a user turn's first step.
    bridge_ids: list[int] | None = None
    outcome: str | None = None  # on the conversation's last step: why it ended ("complete", "truncated", ...)
    source_id: str | None = None  # see Prompt.source_id

    def __post_init__(self) -> None:
        self.messages = _messages_in(self.messages)
        # Built with None (as callers did before these were always ints): the implied 0.
        self.step = self.step or 0
        self.turn_index = self.turn_index or 0
        if self.tool_calls is not None:
            self.tool_calls = [c if isinstance(c, ToolCall) else ToolCall.from_dict(c) for c in self.tool_calls]

    def to_json(self) -> str:
        return _record_json(self)

    @classmethod
    def from_json(cls, line: str) -> Completion:
        return cls(**json.loads(line))


COMPLETION_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("request_key", pa.string(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("category", pa.string()),
    ]
)


@dataclass(slots=True)
class TokenRow:
    """One training example: prompt ids then completion ids, loss on the completion only."""

    prompt_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    request_key: str
    category: str | None = None
    num_turns: int = 1
    normalized: str | None = None  # see Prompt.normalized: the prompt text was normalized at load ("NFC")
    # Where the row sits in its conversation (single-turn mode: one row per conversation, one loss span).
    conversation_id: str | None = None  # the published conversation's `id` (today the prompt id)
    turn_index: int = 0  # 0-based index of the user turn whose answer this row trains on
    num_loss_spans: int = 1  # runs of loss_mask == 1 (one per generated assistant message)
    span_finish_reasons: list[str] | None = None  # each loss span's finish reason, in order
    # Where the conversation came from (issue 47): its row's place ("file:line", see Prompt.location) and own id.
    location: str | None = None
    source_id: str | None = None


TOKEN_ROW_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("request_key", pa.string(), nullable=False),
        pa.field("num_turns", pa.int16(), nullable=False),
        pa.field("normalized", pa.string()),
        # Added with conversations; nullable so files written before them read with this schema (as nulls).
        pa.field("conversation_id", pa.string()),
        pa.field("turn_index", pa.int16()),
        pa.field("num_loss_spans", pa.int16()),
        pa.field("span_finish_reasons", pa.list_(pa.string())),
        # Added with issue 47 (nullable, so files written before read with this schema): the source row.
        pa.field("location", pa.string()),
        pa.field("source_id", pa.string()),
    ]
)
