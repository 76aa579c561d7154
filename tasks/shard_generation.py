"""The shard driver's records (tasks/generation.py): the shard's prompts, the stage's result, the requests in flight,
and the two records a finished or refused request becomes: the checkpoint line of a completion and the generation
reject row.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.checkpoint import CheckpointError, read_rows, summarize
from datagen.conversation.toolcalls import answer_text, parse_tool_calls
from datagen.engine.client import GenerateResult, ProtocolError, RequestRejected
from datagen.engine.dispatcher import Dispatcher
from datagen.records import Completion, Prompt, Reject, ToolCall

__all__ = [
    "SUBMIT_POLL_S",
    "GenerationIncomplete",
    "InFlight",
    "Refused",
    "ShardResult",
    "completion_record",
    "expect",
    "generation_reject",
    "read_prompts",
    "shard_result",
]

logger = logging.getLogger("datagen.generation")
T = TypeVar("T")

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
        source_id=prompt.source_id,
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
        source_id=prompt.source_id,
    )


def _tool_calls(prompt: Prompt, text: str) -> list[ToolCall] | None:
    """The calls in the answer of a prompt that declares tools (parsed as SGLang's qwen3_coder parser does)."""
    if not prompt.tools:
        return None
    return parse_tool_calls(answer_text(text), prompt.tools) or None


@dataclass(frozen=True, slots=True)
class Refused:
    """A request the server refused for what it is (a 4xx, an answer that breaks the protocol): a reject row."""

    reason: str  # server_rejected | protocol_error
    detail: str


class InFlight(Generic[T]):
    """A shard's requests in the dispatcher: what each future is for, finished ones as they come, the failures.

    Done-callbacks run on the dispatcher's thread and only queue the future; the shard's own thread takes them
    (`finished`) and writes, so the checkpoint has one writer.
    """

    def __init__(self) -> None:
        self.items: dict[concurrent.futures.Future[GenerateResult], T] = {}
        self._finished: queue.SimpleQueue[concurrent.futures.Future[GenerateResult]] = queue.SimpleQueue()
        self.failures: list[BaseException] = []
        self.n_sent = 0

    def add(self, fut: concurrent.futures.Future[GenerateResult], item: T) -> None:
        self.items[fut] = item
        fut.add_done_callback(self._finished.put)  # after the entry exists: `finished` pops it
        self.n_sent += 1

    def finished(self, timeout: float) -> list[tuple[GenerateResult | Refused | None, T]]:
        """Each finished request's outcome (None: a failure not about it, kept in `failures`) and its item; waits
        up to `timeout` for the first one when none has finished."""
        batch: list[concurrent.futures.Future[GenerateResult]] = []
        try:
            batch.append(self._finished.get(timeout=timeout) if timeout > 0 else self._finished.get_nowait())
            while True:
                batch.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        return [(self._outcome(fut), self.items.pop(fut)) for fut in batch]

    def _outcome(self, fut: concurrent.futures.Future[GenerateResult]) -> GenerateResult | Refused | None:
        try:
            return fut.result()
        except RequestRejected as exc:
            return Refused("server_rejected", f"{exc.server}: {exc.message}")
        except ProtocolError as exc:
            return Refused("protocol_error", str(exc))
        except Exception as exc:  # not about this request: left unsettled so a shard retry sends it again
            self.failures.append(exc)
            return None

    def cancel(self) -> None:
        """Cancel what is still queued; what runs finishes on the servers, unrecorded."""
        for fut in self.items:
            fut.cancel()

    def check(self, shard_id: int, unit: str, resumed: str) -> None:
        """GenerationIncomplete when a request sent got no result (`unit`: what was sent; `resumed`: on a retry)."""
        if self.failures:
            raise GenerationIncomplete(
                f"shard {shard_id}: {len(self.failures)} of {self.n_sent} {unit} sent got no result; {resumed}. "
                f"First error: {self.failures[0]}"
            ) from self.failures[0]


def expect(dispatcher: Dispatcher | None, shard_id: int, todo: int, unit: str) -> None:
    """Tell the dispatcher how many `unit` (requests, conversations) the shard will send; RuntimeError when it has
    work but no servers were started for it (the caller asked `unsettled_requests` and was told otherwise)."""
    if not todo:
        return
    if dispatcher is None:
        raise RuntimeError(f"shard {shard_id}: {todo} {unit} to generate but no servers were started for it")
    dispatcher.add_expected(todo)


def shard_result(
    shard_id: int, completions_path: Path, rejects_path: Path, n_prompts: int, n_sent: int, lines: int | None = None
) -> ShardResult:
    """The stage's result from the shard's finished checkpoint (lines, tokens, checksum), logged.

    `lines`: how many lines the two files must hold together (`last`: one per request); CheckpointError if not.
    """
    n_completed, output_tokens, sha = summarize(completions_path)
    n_rejected = sum(1 for _ in read_rows(rejects_path))
    if lines is not None and n_completed + n_rejected != lines:
        raise CheckpointError(f"shard {shard_id}: {n_completed} completed + {n_rejected} rejected != {lines} requests")
    logger.info(
        "shard %d done: %d completed, %d rejected, %d sent now, %d output tokens",
        shard_id,
        n_completed,
        n_rejected,
        n_sent,
        output_tokens,
    )
    return ShardResult(
        shard_id=shard_id,
        completions_path=str(completions_path),
        rejects_path=str(rejects_path),
        n_prompts=n_prompts,
        n_completed=n_completed,
        n_rejected=n_rejected,
        n_sent=n_sent,
        output_tokens=output_tokens,
        completions_sha256=sha,
    )
