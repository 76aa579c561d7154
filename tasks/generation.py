"""Generation stage for one shard: its conversations in, step lines and reject rows appended to a checkpoint.

Every prompt is a conversation; the run's turn mode (datagen/conversation/turn_mode.py, chosen once from the
spec) says which of its steps are generated: `last`, one step (the recorded conversation's last reply, from
planning's render); `every`, each assistant turn in order, step N keyed `<conversation's request key>:step-N`.
One driver runs both:

- The shard's two checkpoint files (datagen.checkpoint: JSON lines of `Completion` and `Reject`) are an
  exactly-once ledger keyed by step (datagen/conversation/ledger.py): a rerun reads them, takes every conversation
  whose last line ends it or that has a reject line as settled, and restarts every other one at its first
  unwritten step (`Regenerator.resume`). A line is written before its successor is requested, so every step is
  generated once. Results are written to the OS as they arrive and fsync'd at least every `flush_interval_s`, so
  a crash loses at most the steps in flight. The stage returns a small `ShardResult`, never the data.
- A shard keeps no window of its own: it hands steps to the box's one `Dispatcher`, whose `submit` blocks while
  the dispatcher's queue is full, and writes results while it waits. When a step finishes, its line is written
  and the conversation's next step goes to the same dispatcher at once: no barrier per conversation or shard.
- Order: a shard reserves its place in the plan order before it reads its checkpoint (a higher shard's worker
  that gets to the preparation turn first must not send ahead of it, datagen/engine/gate.py), and prepares each
  request under the turn, in plan order. In `last` mode the plan order is the schedule and the reservation holds
  until every request is queued. In `every` mode conversations open, and ready steps are sent, most work left
  first (`work_left`: its remaining steps' expected lengths, summed; plan order breaks ties), so the longest
  chains start early (benchmarks/README.md, conversations); the reservation holds until the shard's first step
  is queued, and from then on a shard holding no request goes first in plan order: every shard keeps one in
  flight, so none is starved (`TurnMode.send_order`).
- A step that fails validation's per-sample checks ends its conversation (`rejected_<reason>`, every turn):
  validation would cut the conversation there anyway, so nothing after it is generated.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import json
import logging
from pathlib import Path

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointAppender, CheckpointError
from datagen.conversation.ledger import Ledger, read_ledger
from datagen.conversation.regeneration import Ended, StepRequest
from datagen.conversation.turn_mode import Conversation, Steps, TurnMode, turn_mode
from datagen.engine.client import GenerateResult, sampling_params_for
from datagen.engine.dispatcher import Dispatcher, GenerateJob, SubmitTimeout
from datagen.identity import RequestKeys
from datagen.layout import RunLayout
from datagen.operations.faults import kill_point
from datagen.records import Completion
from datagen.runspec import RunSpec
from datagen.sources.preparation import Unsendable
from tasks.ordering import LengthModel, StepLengths, StepModel, step_lengths
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
    "StepTokens",
    "completion_record",
    "conversation_keys",
    "generate_shard",
    "generation_reject",
    "pilot_step_tokens",
    "read_prompts",
    "unsettled_requests",
]

# A conversation's expected output tokens of each step, in order (the pilot's, `pilot_step_tokens`); None: each is 1.
StepTokens = StepLengths

logger = logging.getLogger("datagen.generation")

_Item = tuple[Conversation, StepRequest]  # a step in flight or ready: its conversation and its request


def conversation_keys(layout: RunLayout, shard_id: int, chat: ChatTokenizer, spec: RunSpec) -> dict[str, str]:
    """Each conversation's request key and its prompt id, in the shard's order (a prompt listed twice once)."""
    key_of = RequestKeys(spec.sampling, chat)
    keys: dict[str, str] = {}
    for prompt in read_prompts(layout.shard_prompts(shard_id)):
        keys.setdefault(key_of(prompt.prompt_id), prompt.prompt_id)
    return keys


def unsettled_requests(shard_id: int, layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> int:
    """Conversations of the shard its checkpoint has not settled: 0 means the shard needs no server."""
    keys = conversation_keys(layout, shard_id, chat, spec)
    ledgers = read_ledger(
        layout.shard_completions(shard_id), layout.shard_rejects(shard_id), set(keys), turn_mode(spec)
    )
    return sum(1 for key in keys if key not in ledgers or not ledgers[key].settled)


def pilot_step_tokens(layout: RunLayout, spec: RunSpec) -> StepTokens | None:
    """Expected tokens of each step from the run's pilot, when its projection is on this box (None: steps count).

    An every-turn pilot measured step lengths by category and kind (first user turn, later turns, tool rounds:
    `step_model`); a conversation's steps are its recorded ones, each that kind's mean. A pilot file without them
    (a `last` mode pilot, or one written before) gives its length model's prediction of the whole output, shared
    evenly over the expected steps. `tasks.ordering.step_lengths`, the call the pilot's projection simulates.
    """
    if spec.pilot is None:
        return None
    # The pilot is a run beside this one (RunLayout.for_run); its projection is tasks.pilot.PILOT_JSON (not imported:
    # the pilot's modules build on this one).
    path = layout.root.parent / spec.pilot / "pilot.json"
    try:
        pilot = json.loads(path.read_text(encoding="utf-8"))
        model = LengthModel.model_validate(pilot["length_model"])
        steps = StepModel.model_validate(pilot["step_model"]) if pilot.get("step_model") is not None else None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # e.g. a box of a multi-box run: no pilot file
        logger.info("ranking conversations by steps left: no pilot length model at %s (%s)", path, exc)
        return None
    logger.debug("ranking conversations by the pilot's %s", "step lengths" if steps else "length model")
    return step_lengths(model, steps)


def generate_shard(
    shard_id: int,
    layout: RunLayout,
    dispatcher: Dispatcher | None,
    chat: ChatTokenizer,
    spec: RunSpec,
    flush_interval_s: float = 2.0,
    step_tokens: StepTokens | None = None,
) -> ShardResult:
    """Generate every conversation of one shard its checkpoint has not settled, each step once; counts in
    `ShardResult` are conversations (`n_prompts`), step lines (`n_completed`) and reject lines (`n_rejected`).

    `dispatcher` may be None when the caller knows (`unsettled_requests`) that the checkpoint settles them all.
    `step_tokens` (every turn): each conversation's expected tokens of each step, for ranking by work left (None:
    the run's pilot's lengths when its projection is on this box, else each step counts 1).
    """
    with contextlib.ExitStack() as place:
        if dispatcher is not None:
            # The shard's place in the plan order, held while its checkpoint is read: a higher shard's worker that
            # gets to the turn first must not send ahead of it (gate.py).
            place.enter_context(dispatcher.turn.reserved((shard_id,)))
        mode = turn_mode(spec)
        given = step_tokens
        step_tokens = mode.ranking_lengths(lambda: given if given is not None else pilot_step_tokens(layout, spec))
        return _ShardDriver(shard_id, layout, dispatcher, chat, spec, mode, flush_interval_s, place, step_tokens).run()


class _ShardDriver:
    """The generation of one shard: its conversations, their steps in flight, and their ledger."""

    def __init__(
        self,
        shard_id: int,
        layout: RunLayout,
        dispatcher: Dispatcher | None,
        chat: ChatTokenizer,
        spec: RunSpec,
        mode: TurnMode,
        flush_interval_s: float,
        place: contextlib.ExitStack,
        step_tokens: StepTokens | None,
    ) -> None:
        self.shard_id = shard_id
        self.mode = mode
        self.step_tokens = mode.ranking_lengths(lambda: step_tokens)
        self.place = place  # the shard's reservation of its plan order (see the module docstring)
        self.completions_path, self.rejects_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        self.prompts_path = layout.shard_prompts(shard_id)
        self.dispatcher = dispatcher
        self.spec, self.chat = spec, chat
        self.sampling = sampling_params_for(spec.sampling)
        self.flush_interval_s = flush_interval_s
        self.key_of = RequestKeys(spec.sampling, chat)
        self.inflight: InFlight[_Item] = InFlight()
        # Next steps of conversations under way, most work left first: (rank, arrival, item).
        self.ready: list[tuple[tuple[float, int], int, _Item]] = []
        self._arrivals = itertools.count()
        self.steps: Steps  # made by run() when a conversation is left to generate
        self.completions: CheckpointAppender  # opened by run(), once the ledger is known to be this shard's
        self.rejects: CheckpointAppender

    def run(self) -> ShardResult:
        conversations: dict[str, Conversation] = {}
        duplicates = 0
        for row, prompt in enumerate(read_prompts(self.prompts_path)):
            key = self.key_of(prompt.prompt_id)
            duplicates += key in conversations
            if key not in conversations:
                if self.step_tokens is not None:
                    expected = self.step_tokens(prompt)
                else:  # each expected step counts 1
                    expected = (1.0,) * self.mode.expected_steps(prompt)
                conversations[key] = Conversation(prompt, row, key, tuple(max(t, 1e-6) for t in expected))
        if duplicates:
            logger.warning("shard %d: %d duplicate prompt ids are generated once", self.shard_id, duplicates)
        ledgers = read_ledger(self.completions_path, self.rejects_path, set(conversations), self.mode)
        todo = [c for key, c in conversations.items() if key not in ledgers or not ledgers[key].settled]
        # Most work left first (a resumed conversation counts from its first unwritten step); plan order on ties.
        todo.sort(key=lambda c: self._rank(c, len(ledgers[c.key].lines) if c.key in ledgers else 0))
        logger.info(
            "shard %d (turns: %s): %d conversations, %d settled in checkpoint (%d step lines), %d to do",
            self.shard_id,
            self.mode.name,
            len(conversations),
            len(conversations) - len(todo),
            sum(len(ledger.lines) for ledger in ledgers.values()),
            len(todo),
        )
        expect(self.dispatcher, self.shard_id, len(todo), "conversations")
        self.completions = CheckpointAppender(self.completions_path, self.flush_interval_s)
        self.rejects = CheckpointAppender(self.rejects_path, self.flush_interval_s)
        try:
            if todo:  # nothing to open: the checkpoint (or a pilot's import) settled every conversation
                assert self.dispatcher is not None
                self.steps = self.mode.steps(self.spec, self.chat, self.prompts_path)
                self._generate(collections.deque(todo), ledgers)
        finally:
            self.inflight.cancel()
            self.completions.close()
            self.rejects.close()
        self.inflight.check(
            self.shard_id,
            "requests",
            "everything before them is checkpointed and a retry sends only those (each conversation from its first "
            "unwritten step)",
        )
        return self._result(conversations)

    @staticmethod
    def _rank(conv: Conversation, step: int) -> tuple[float, int]:
        """Most work left first, then plan order."""
        return (-conv.work_left(step), conv.row)

    def _generate(self, todo: collections.deque[Conversation], ledgers: dict[str, Ledger]) -> None:
        """Send ready steps and open conversations, most work left first, writing results as they come."""
        dispatcher = self.dispatcher
        assert dispatcher is not None  # only unsettled conversations get here, and those need servers
        opened: _Item | None = None  # prepared, waiting for room

        def opening_rank(conv: Conversation) -> tuple[float, int]:
            return self._rank(conv, len(ledgers[conv.key].lines) if conv.key in ledgers else 0)

        while True:
            self._harvest(0)
            best = self.ready[0][0] if self.ready else None
            if opened is None and todo and (best is None or opening_rank(todo[0]) < best):
                opened = self._open_next(todo, ledgers)
                continue  # a rejected opening may have settled others meanwhile: rank again
            from_ready = bool(self.ready) and (
                opened is None or (best is not None and best <= self._rank(opened[0], opened[1].step))
            )
            if from_ready:
                entry = heapq.heappop(self.ready)
                item = entry[2]
            elif opened is not None:
                item = opened
            else:
                self.place.close()  # every conversation is open: later shards may go ahead now
                if not self.inflight.items:
                    return
                self._harvest(self.flush_interval_s)
                continue
            conv, req = item
            order = self.mode.send_order(self.shard_id, conv.row, conv.work_left(req.step), len(self.inflight.items))
            job = GenerateJob(
                req.prompt_ids,
                self.sampling,
                label=self.mode.step_key(conv.prompt.prompt_id, req.step),
                order=order,
                # Every turn: a step goes back to the server whose radix cache holds its prefix (dispatcher.py).
                affinity=self.mode.affinity(conv.key),
            )
            try:
                fut = dispatcher.submit(job, timeout=SUBMIT_POLL_S)
            except SubmitTimeout:
                if from_ready:
                    heapq.heappush(self.ready, entry)
                continue  # (a prepared opening stays in `opened`)
            if not from_ready:
                opened = None
            self.inflight.add(fut, item)
            # Its first step is in the queue: where the shard's share keeps it from starving from here on, later
            # shards may prepare theirs (the reservation only covers a late start, e.g. a long checkpoint read).
            self.mode.first_step_queued(self.place)

    def _open_next(self, todo: collections.deque[Conversation], ledgers: dict[str, Ledger]) -> _Item | None:
        """The next conversation's next step (step 0, or where a crash left it); None when none is left."""
        dispatcher = self.dispatcher
        assert dispatcher is not None
        while todo:
            conv = todo.popleft()
            order = (self.shard_id, conv.row)
            while not dispatcher.turn.acquire(order, timeout=SUBMIT_POLL_S):  # prepared in plan order
                self._harvest(0)  # (writing finished results while it waits)
            try:
                ledger = ledgers.get(conv.key)
                lines = ledger.lines if ledger is not None else []
                try:
                    req = self._resume(conv, lines) if lines else self.steps.first(conv)
                except Unsendable as exc:
                    req = None
                    self._write_reject(conv, len(lines), exc.reason, exc.detail)
            finally:
                dispatcher.turn.release()
            if req is not None:
                return conv, req
            dispatcher.add_expected(-1)  # settled here, never sent
        return None

    def _resume(self, conv: Conversation, lines: list[tuple[int, int, int, int]]) -> StepRequest | None:
        """The step after a conversation's last line, from its lines; None when it ends there (a reject says why)."""
        turn = lines[-1][1]
        steps = [_line_at(self.completions_path, offset, length) for _, t, offset, length in lines if t == turn]
        try:
            last = self.steps.resume(conv, steps)
        except ValueError as exc:  # Unsendable too: it was sent once, so the template or model changed
            raise CheckpointError(f"{self.completions_path}: cannot resume: {exc}") from exc
        nxt = self.steps.after(conv, last, steps[-1])
        if isinstance(nxt, Ended):  # its line was written as continuing, so the rules changed since: end it here
            self._write_reject(conv, len(lines), nxt.outcome, f"{nxt.detail} (decided when resuming)")
            return None
        logger.debug("conversation %s resumes at step %d", conv.prompt.prompt_id, nxt.step)
        return nxt

    def _harvest(self, timeout: float) -> None:
        """Write every finished step and queue its successor; wait up to `timeout` for the first one."""
        for outcome, (conv, req) in self.inflight.finished(timeout):
            self._settle(outcome, conv, req)
        self.completions.sync_if_due()
        self.rejects.sync_if_due()

    def _settle(self, result: GenerateResult | Refused | None, conv: Conversation, req: StepRequest) -> None:
        if isinstance(result, Refused):
            self._write_reject(conv, req.step, result.reason, result.detail)
            return
        if result is None:  # not about this step (InFlight.failures): left unsettled, a shard retry resumes here
            return
        c = completion_record(
            conv.prompt, self.mode.step_key(conv.key, req.step), len(req.prompt_ids), result, conv.row
        )
        assert self.dispatcher is not None
        try:
            with self.mode.preparing_next(self.dispatcher.turn((self.shard_id, conv.row))):
                nxt = self.steps.after(conv, req, c)
        except Unsendable as exc:  # the next user turn cannot be rendered: its reject ends the conversation
            self.completions.write(self.steps.record(c, req, None).to_json())
            self._write_reject(conv, req.step + 1, exc.reason, exc.detail)
            return
        if isinstance(nxt, Ended):
            self.completions.write(self.steps.record(c, req, nxt).to_json())
            return
        self.completions.write(self.steps.record(c, req, None).to_json())
        kill_point("generate.mid-conversation")
        self.dispatcher.add_expected(1)
        heapq.heappush(self.ready, (self._rank(conv, nxt.step), next(self._arrivals), (conv, nxt)))

    def _write_reject(self, conv: Conversation, step: int, reason: str, detail: str) -> None:
        key, where = self.mode.step_key(conv.key, step), self.mode.reject_detail(conv, step, detail)
        self.rejects.write(generation_reject(conv.prompt, key, reason, where).to_json())

    def _result(self, conversations: dict[str, Conversation]) -> ShardResult:
        ledgers = read_ledger(self.completions_path, self.rejects_path, set(conversations), self.mode)
        open_ = [key for key in conversations if key not in ledgers or not ledgers[key].settled]
        if open_:
            raise CheckpointError(f"shard {self.shard_id}: {len(open_)} conversations neither ended nor rejected")
        return shard_result(
            self.shard_id, self.completions_path, self.rejects_path, len(conversations), self.inflight.n_sent
        )


def _line_at(path: Path, offset: int, length: int) -> Completion:
    with open(path, "rb") as f:
        f.seek(offset)
        return Completion.from_json(f.read(length).decode("utf-8"))
