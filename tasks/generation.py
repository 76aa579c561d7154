"""Generation stage for one shard: prompts in, completions and reject rows appended to a checkpoint.

The shard's two checkpoint files (datagen.checkpoint: JSON lines of `Completion` and `Reject`) are an
exactly-once ledger keyed by `request_key`: a rerun reads them, skips every request already settled and sends
only the rest. Results are written to the OS as they arrive and fsync'd at least every `flush_interval_s`, so a
crash loses at most the requests in flight. Token ids come from planning's render (datagen.preparation), so a
prompt is rendered once per run. The stage returns a small `ShardResult` (paths, counts, checksum), never the data.

A shard keeps no window of its own: it hands requests to the box's one `Dispatcher`, whose `submit` blocks
while the dispatcher's queue is full (a limit that follows the servers' live capacity), and writes results
while it waits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointAppender, CheckpointError, read_rows, settled_keys, summarize
from datagen.engine.client import GenerateResult, ProtocolError, RequestRejected, sampling_params_for
from datagen.engine.dispatcher import Dispatcher, GenerateJob, SubmitTimeout
from datagen.identity import RequestKeys, preparer_for
from datagen.layout import RunLayout
from datagen.preparation import Unsendable, read_rendered
from datagen.records import Completion, Prompt, Reject, ToolCall
from datagen.runspec import RunSpec
from datagen.toolcalls import answer_text, parse_tool_calls

__all__ = [
    "CheckpointError",
    "GenerationIncomplete",
    "ShardResult",
    "completion_record",
    "generate_shard",
    "generation_reject",
    "read_prompts",
    "unsettled_requests",
]

logger = logging.getLogger("datagen.generation")

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


def unsettled_requests(shard_id: int, layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> int:
    """Requests of the shard its checkpoint has no result for: 0 means the shard needs no server.

    In `turns: every` mode: the conversations it has not settled (their further steps are not known yet).
    """
    if spec.turns == "every":
        from tasks.generation_turns import unsettled_conversations  # it builds on this module

        return unsettled_conversations(shard_id, layout, chat, spec)
    key_of = RequestKeys(spec.sampling, chat)
    keys = {key_of(p.prompt_id) for p in read_prompts(layout.shard_prompts(shard_id))}
    settled = settled_keys(layout.shard_completions(shard_id), "completion") | settled_keys(
        layout.shard_rejects(shard_id), "reject"
    )
    return len(keys - settled)


def generate_shard(
    shard_id: int,
    layout: RunLayout,
    dispatcher: Dispatcher | None,
    chat: ChatTokenizer,
    spec: RunSpec,
    flush_interval_s: float = 2.0,
    step_tokens: Callable[[Prompt], float] | None = None,
) -> ShardResult:
    """Generate every request of one shard not yet in its checkpoint; return counts and the checksum.

    `dispatcher` may be None when the caller knows (`unsettled_requests`) that the checkpoint settles them all.
    In `turns: every` mode each prompt is a conversation generated step by step (tasks/generation_turns.py);
    `step_tokens` (e.g. the pilot's length model) ranks its conversations by the work they have left.
    """
    if spec.turns == "every":
        from tasks.generation_turns import generate_conversations  # it builds on this module

        return generate_conversations(shard_id, layout, dispatcher, chat, spec, flush_interval_s, step_tokens)
    with contextlib.ExitStack() as place:
        if dispatcher is not None:
            # The shard's place in the plan order, held while its checkpoint is read: a higher shard's worker that
            # gets to the turn first must not send ahead of it (gate.py).
            place.enter_context(dispatcher.turn.reserved((shard_id,)))
        return _generate_requests(shard_id, layout, dispatcher, chat, spec, flush_interval_s, place)


def _generate_requests(
    shard_id: int,
    layout: RunLayout,
    dispatcher: Dispatcher | None,
    chat: ChatTokenizer,
    spec: RunSpec,
    flush_interval_s: float,
    place: contextlib.ExitStack,
) -> ShardResult:
    """`generate_shard` for one request per prompt; `place` (closed once every request is sent) holds its order."""
    prompts_path = layout.shard_prompts(shard_id)
    completions_path, rejects_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
    key_of = RequestKeys(spec.sampling, chat)

    # Pass 1 (keys only, no tokenization): what the shard holds and what its checkpoint already settled.
    shard_keys: set[str] = set()
    duplicates = 0
    for prompt in read_prompts(prompts_path):
        key = key_of(prompt.prompt_id)
        duplicates += key in shard_keys
        shard_keys.add(key)
    done_completed = settled_keys(completions_path, "completion")
    done_rejected = settled_keys(rejects_path, "reject")
    settled = done_completed | done_rejected
    foreign = settled - shard_keys
    if done_completed & done_rejected or foreign:
        raise CheckpointError(
            f"shard {shard_id}: checkpoint {completions_path.name}/{rejects_path.name} holds "
            f"{len(foreign)} requests not in this shard under this spec and model (sampling, model or template "
            f"changed?) and {len(done_completed & done_rejected)} both completed and rejected; "
            "use a new namespace instead of mixing"
        )
    if duplicates:
        logger.warning("shard %d: %d duplicate prompt ids are generated once", shard_id, duplicates)
    todo = len(shard_keys) - len(settled)
    logger.info(
        "shard %d: %d requests, %d settled in checkpoint, %d to do", shard_id, len(shard_keys), len(settled), todo
    )
    if todo:
        if dispatcher is None:
            raise RuntimeError(f"shard {shard_id}: {todo} requests to send but no servers were started for it")
        dispatcher.add_expected(todo)

    sampling = sampling_params_for(spec.sampling)
    prepare = preparer_for(spec, chat)
    # Planning's render of these prompts (None: render here, e.g. a shard fetched by a box of a multi-box run).
    rendered = read_rendered(prompts_path, prepare.render_key) if todo else None
    inflight: dict[concurrent.futures.Future[GenerateResult], tuple[Prompt, str, int, int]] = {}
    # Futures land here as they finish (done-callbacks run on the dispatcher's thread; only this one writes).
    finished: queue.SimpleQueue[concurrent.futures.Future[GenerateResult]] = queue.SimpleQueue()
    failures: list[BaseException] = []
    n_sent = 0
    seen: set[str] = set()
    completions = CheckpointAppender(completions_path, flush_interval_s)
    rejects = CheckpointAppender(rejects_path, flush_interval_s)

    def harvest(timeout: float) -> None:
        """Write every finished result; wait up to `timeout` for the first one when none has finished."""
        batch: list[concurrent.futures.Future[GenerateResult]] = []
        try:
            batch.append(finished.get(timeout=timeout) if timeout > 0 else finished.get_nowait())
            while True:
                batch.append(finished.get_nowait())
        except queue.Empty:
            pass
        for fut in batch:
            prompt, key, sent, plan_index = inflight.pop(fut)
            try:
                result = fut.result()
            except RequestRejected as exc:
                rejects.write(
                    generation_reject(prompt, key, "server_rejected", f"{exc.server}: {exc.message}").to_json()
                )
            except ProtocolError as exc:
                rejects.write(generation_reject(prompt, key, "protocol_error", str(exc)).to_json())
            except Exception as exc:  # not about this prompt: left unsettled so a shard retry resends it
                failures.append(exc)
            else:
                completions.write(completion_record(prompt, key, sent, result, plan_index).to_json())
        completions.sync_if_due()
        rejects.sync_if_due()

    def settled_unsent() -> None:
        """A request this shard settled itself (a reject before sending): the dispatcher expects one fewer."""
        assert dispatcher is not None
        dispatcher.add_expected(-1)

    def take_turn(order: tuple[int, int]) -> None:
        """Wait for this request's turn to be prepared, writing finished results meanwhile."""
        assert dispatcher is not None
        while not dispatcher.turn.acquire(order, timeout=SUBMIT_POLL_S):
            harvest(0)

    def submit(job: GenerateJob) -> concurrent.futures.Future[GenerateResult]:
        """Hand one request to the dispatcher, writing finished results while it has no room."""
        assert dispatcher is not None  # only unsettled requests are sent, and those need servers (checked above)
        while True:
            try:
                return dispatcher.submit(job, timeout=SUBMIT_POLL_S)
            except SubmitTimeout:
                harvest(0)

    try:
        for row, prompt in enumerate(read_prompts(prompts_path)):
            key = key_of(prompt.prompt_id)
            if key in settled or key in seen:
                continue
            seen.add(key)
            assert dispatcher is not None  # unsettled requests exist only with servers (checked above)
            take_turn((shard_id, row))  # prepared in plan order, like the queue lets them in
            try:
                ids = prepare.fitting(rendered[row]) if rendered is not None else prepare(prompt.messages, prompt.tools)
            except Unsendable as exc:
                rejects.write(generation_reject(prompt, key, exc.reason, exc.detail).to_json())
                settled_unsent()
                continue
            finally:
                dispatcher.turn.release()
            job = GenerateJob(ids, sampling, label=prompt.prompt_id, order=(shard_id, row))  # the plan's order
            fut = submit(job)
            inflight[fut] = (prompt, key, len(ids), row)
            fut.add_done_callback(finished.put)  # after the entry exists: harvest pops it
            n_sent += 1
            harvest(0)
        place.close()  # every request is in the dispatcher's queue: later shards may go ahead now
        while inflight:
            harvest(flush_interval_s)
    finally:
        for fut in inflight:
            fut.cancel()  # only queued ones cancel; what runs finishes on the servers, unrecorded
        completions.close()
        rejects.close()

    if failures:
        raise GenerationIncomplete(
            f"shard {shard_id}: {len(failures)} of {n_sent} requests sent got no result; everything else is "
            f"checkpointed and a retry sends only those. First error: {failures[0]}"
        ) from failures[0]

    n_completed, output_tokens, sha = summarize(completions_path)
    n_rejected = sum(1 for _ in read_rows(rejects_path))
    if n_completed + n_rejected != len(shard_keys):
        raise CheckpointError(
            f"shard {shard_id}: {n_completed} completed + {n_rejected} rejected != {len(shard_keys)} requests"
        )
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
        n_prompts=len(shard_keys),
        n_completed=n_completed,
        n_rejected=n_rejected,
        n_sent=n_sent,
        output_tokens=output_tokens,
        completions_sha256=sha,
    )
