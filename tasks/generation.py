"""Generation stage for one shard: prompts in, completions and reject rows appended to a checkpoint.

The shard's two checkpoint files (datagen.checkpoint: JSON lines of `Completion` and `Reject`) are an
exactly-once ledger keyed by `request_key`: a rerun reads them, skips every request already settled and sends
only the rest. Results are written to the OS as they arrive and fsync'd at least every `flush_interval_s`, so a
crash loses at most the requests in flight. Token ids come from planning's render (datagen.sources.preparation), so a
prompt is rendered once per run. The stage returns a small `ShardResult` (paths, counts, checksum), never the data.

A shard keeps no window of its own: it hands requests to the box's one `Dispatcher`, whose `submit` blocks
while the dispatcher's queue is full (a limit that follows the servers' live capacity), and writes results
while it waits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointAppender, CheckpointError, settled_keys
from datagen.engine.client import GenerateResult, sampling_params_for
from datagen.engine.dispatcher import Dispatcher, GenerateJob, SubmitTimeout
from datagen.identity import RequestKeys, preparer_for
from datagen.layout import RunLayout
from datagen.records import Prompt
from datagen.runspec import RunSpec
from datagen.sources.preparation import Unsendable, read_rendered
from tasks.generation_turns import generate_conversations, unsettled_conversations
from tasks.shard_generation import (
    SUBMIT_POLL_S,
    GenerationIncomplete,
    InFlight,
    Refused,
    ShardResult,
    completion_record,
    expect,
    generation_reject,
    read_prompts,
    shard_result,
)

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


def unsettled_requests(shard_id: int, layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> int:
    """Requests of the shard its checkpoint has no result for: 0 means the shard needs no server.

    In `turns: every` mode: the conversations it has not settled (their further steps are not known yet).
    """
    if spec.turns == "every":
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
    with contextlib.ExitStack() as place:
        if dispatcher is not None:
            # The shard's place in the plan order, held while its checkpoint is read: a higher shard's worker that
            # gets to the turn first must not send ahead of it (gate.py).
            place.enter_context(dispatcher.turn.reserved((shard_id,)))
        if spec.turns == "every":
            return generate_conversations(
                shard_id, layout, dispatcher, chat, spec, flush_interval_s, place, step_tokens
            )
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
    expect(dispatcher, shard_id, todo, "requests")

    sampling = sampling_params_for(spec.sampling)
    prepare = preparer_for(spec, chat)
    # Planning's render of these prompts (None: render here, e.g. a shard fetched by a box of a multi-box run).
    rendered = read_rendered(prompts_path, prepare.render_key) if todo else None
    inflight: InFlight[tuple[Prompt, str, int, int]] = InFlight()
    seen: set[str] = set()
    completions = CheckpointAppender(completions_path, flush_interval_s)
    rejects = CheckpointAppender(rejects_path, flush_interval_s)

    def harvest(timeout: float) -> None:
        """Write every finished result; wait up to `timeout` for the first one when none has finished."""
        for outcome, (prompt, key, sent, plan_index) in inflight.finished(timeout):
            if isinstance(outcome, Refused):
                rejects.write(generation_reject(prompt, key, outcome.reason, outcome.detail).to_json())
            elif outcome is not None:
                completions.write(completion_record(prompt, key, sent, outcome, plan_index).to_json())
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
            inflight.add(submit(job), (prompt, key, len(ids), row))
            harvest(0)
        place.close()  # every request is in the dispatcher's queue: later shards may go ahead now
        while inflight.items:
            harvest(flush_interval_s)
    finally:
        inflight.cancel()
        completions.close()
        rejects.close()

    inflight.check(shard_id, "requests", "everything else is checkpointed and a retry sends only those")
    return shard_result(shard_id, completions_path, rejects_path, len(shard_keys), inflight.n_sent, len(shard_keys))
