"""The data path's records, one type per hop, each beside its Arrow schema.

prompts -> requests -> completions -> verdicts -> token rows -> published objects.
Records cross process boundaries as JSON lines (checkpoints) or parquet (datasets); flows
pass only references (URIs, counts, checksums) to them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa

__all__ = [
    "COMPLETION_SCHEMA",
    "REJECT_SCHEMA",
    "TOKEN_ROW_SCHEMA",
    "Completion",
    "Message",
    "Prompt",
    "Reject",
    "RejectStage",
    "TokenRow",
    "prompt_id_for",
    "prompt_id_from_ids",
]

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}
RejectStage = Literal["load", "generate", "validate", "tokenize"]


def prompt_id_for(source: str, messages: list[Message]) -> str:
    """Id of a prompt without a tokenizer: sha256 over its source label and its messages (24 hex chars).

    Runs use `prompt_id_from_ids` (through datagen.prompts.PromptIdentity) whenever the model is at hand.
    """
    payload = json.dumps([source, [[m["role"], m["content"]] for m in messages]], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def prompt_id_from_ids(source: str, token_ids: list[int]) -> str:
    """Id of a prompt as the model sees it: sha256 over its source label and its rendered token ids."""
    payload = json.dumps([source, token_ids], separators=(",", ":"))
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:24]


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

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

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

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
    ]
)
