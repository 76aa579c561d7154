"""What both shard drivers share (tasks/generation.py for `turns: last`, tasks/generation_turns.py for `every`).

The shard's prompts, the stage's result, and the two records a finished or refused request becomes: the
checkpoint line of a completion and the generation reject row. Neither driver imports the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.checkpoint import CheckpointError
from datagen.engine.client import GenerateResult
from datagen.records import Completion, Prompt, Reject, ToolCall
from datagen.toolcalls import answer_text, parse_tool_calls

__all__ = [
    "SUBMIT_POLL_S",
    "GenerationIncomplete",
    "ShardResult",
    "completion_record",
    "generation_reject",
    "read_prompts",
]

# How long a shard worker waits for room in the dispatcher's queue before it writes what has finished meanwhile.
SUBMIT_POLL_S = 0.25


class GenerationIncomplete(RuntimeError):
    """Some requests of the shard ended without a result (servers down, stalled, retries exhausted).

    Everything else was written, so a retry of the shard sends only the missing requests.
    """


class ShardResult(BaseModel):
    """What the generation stage hands on: references and counts, never records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shard_id: int
    completions_path: str
    rejects_path: str
    n_prompts: int = Field(description="Distinct requests in the shard (conversations in `turns: every` mode).")
    n_completed: int
    n_rejected: int
    n_sent: int = Field(description="Requests sent by this call (0 when the checkpoint already settled all).")
    output_tokens: int
    completions_sha256: str


def read_prompts(path: Path) -> Iterator[Prompt]:
    """The prompts of a shard's prompts file, in plan order."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: shard prompts file missing")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield Prompt.from_json(line)
                except (ValueError, TypeError) as exc:
                    raise CheckpointError(f"{path}: line {n} is not a Prompt: {exc}") from exc


def generation_reject(prompt: Prompt, key: str, reason: str, detail: str) -> Reject:
    """The generation stage's reject row of one request of `prompt`."""
    return Reject(
        stage="generate",
        reason=reason,
        detail=detail,
        source=prompt.source,
        row=prompt.row,
        prompt_id=prompt.prompt_id,
        request_key=key,
        location=prompt.location,
    )


def completion_record(
    prompt: Prompt, key: str, sent_tokens: int, result: GenerateResult, plan_index: int
) -> Completion:
    """The checkpoint line of one finished request of `prompt`, exactly as the server returned it."""
    # plan_index: the prompt's line in its shard, so validation can follow plan order, not finish order.
    meta: dict[str, Any] = {
        "rid": result.rid,
        "finish": result.finish_detail,
        "e2e_latency": result.e2e_latency,
        "plan_index": plan_index,
    }
    if result.prompt_tokens != sent_tokens:
        meta["server_prompt_tokens"] = result.prompt_tokens
    return Completion(
        prompt_id=prompt.prompt_id,
        source=prompt.source,
        row=prompt.row,
        messages=prompt.messages,
        request_key=key,
        prompt_tokens=sent_tokens,
        output_ids=result.output_ids,
        text=result.text,
        finish_reason=result.finish_reason,
        completion_tokens=result.completion_tokens,
        server=result.server,
        latency_s=round(result.latency_s, 3),
        category=prompt.category,
        meta=meta,
        location=prompt.location,
        normalized=prompt.normalized,
        tools=prompt.tools,
        tool_calls=_tool_calls(prompt, result.text),
    )


def _tool_calls(prompt: Prompt, text: str) -> list[ToolCall] | None:
    """The calls in the answer of a prompt that declares tools (parsed as SGLang's qwen3_coder parser does)."""
    if not prompt.tools:
        return None
    return parse_tool_calls(answer_text(text), prompt.tools) or None
