"""Generation of one shard in `turns: every` mode: each conversation step by step through the box's dispatcher.

A shard's prompts are conversations. Step 0 of each is its system messages and first user turn, rendered fresh
(`datagen.conversation.regeneration`; planning's render cache holds the whole row, not this). When a step finishes, its
checkpoint line is written and the conversation's next step goes to the same `Dispatcher` at once: no barrier per
conversation or shard, the servers stay full. A step's request key is `<conversation's request key>:step-N`.

What goes next is ranked by the work a conversation has left (`work_left`: its remaining steps, one per recorded
assistant step of each user turn, times the expected step length; plan order breaks ties): conversations open,
and ready steps are sent, most work left first, so the longest chains start early instead of ending the run
alone (benchmarks/README.md, conversations). A shard keeps its plan-order reservation until its first step is
in the dispatcher's queue; from then on the rank is global across shards, but a shard holding fewer requests
than its share (`ShardShares`, datagen/engine/gate.py) goes first in plan order: none is starved, and the
lowest shards, which the finishing stream waits for, keep advancing.

The checkpoint is the same exactly-once ledger as in `last` mode (datagen.checkpoint), keyed by step: a rerun
reads it, takes every conversation whose last line carries an `outcome` or that has a reject line as settled,
and restarts every other one at its first unwritten step, its history and prompt ids rebuilt from its lines
(`Regenerator.resume`). A line is written before its successor is requested, so every step is generated once.
A step that fails validation's per-sample checks ends its conversation (`rejected_<reason>`): validation would cut
the conversation there anyway, so nothing after it is generated.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointAppender, CheckpointError, read_lines, read_rows
from datagen.checks.quality import check_completion
from datagen.checks.repetition import word_tokens
from datagen.conversation.regeneration import (
    Ended,
    Regenerator,
    Script,
    StepCheck,
    StepRequest,
    split_step_key,
    step_key,
    step_record,
)
from datagen.engine.client import GenerateResult, sampling_params_for
from datagen.engine.dispatcher import Dispatcher, GenerateJob, SubmitTimeout
from datagen.identity import RequestKeys, preparer_for
from datagen.layout import RunLayout
from datagen.operations.faults import kill_point
from datagen.records import Completion, Prompt
from datagen.runspec import RunSpec
from datagen.sources.preparation import Unsendable
from tasks.ordering import LengthModel
from tasks.shard_generation import (
    SUBMIT_POLL_S,
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
    "StepTokens",
    "conversation_keys",
    "expected_steps",
    "generate_conversations",
    "pilot_step_tokens",
    "read_ledger",
    "send_order",
    "step_check",
    "unsettled_conversations",
]

# A conversation's expected output tokens per step (e.g. the pilot's `LengthModel.predict`); None: each step is 1.
StepTokens = Callable[[Prompt], float]


logger = logging.getLogger("datagen.generation")


@dataclass(slots=True)
class _Ledger:
    """What a shard's checkpoint holds of one conversation: its step lines (where they are) and how it ended."""

    lines: list[tuple[int, int, int, int]] = field(default_factory=list)  # (step, turn_index, offset, length)
    ended: bool = False  # its last step line carries an outcome
    rejected_step: int | None = None  # the step a generation reject line settled

    @property
    def settled(self) -> bool:
        return self.ended or self.rejected_step is not None


def read_ledger(completions_path: Path, rejects_path: Path, conversation_keys: set[str]) -> dict[str, _Ledger]:
    """Each conversation's lines in the shard's checkpoint; CheckpointError when they do not fit the shard.

    Foreign lines (not `<key>:step-N` of a conversation of this shard under this spec and model), a key written
    twice, steps not 0, 1, 2, ... in order, a line after the one that ended the conversation, or a reject beside
    a later step: each is a checkpoint this shard did not write.
    """
    ledgers: dict[str, _Ledger] = collections.defaultdict(_Ledger)
    foreign = 0
    for line in read_lines(completions_path):
        row = line.row(completions_path)
        split = split_step_key(str(row.get("request_key", "")))
        if split is None or split[0] not in conversation_keys:
            foreign += 1
            continue
        ledger = ledgers[split[0]]
        if split[1] != len(ledger.lines) or ledger.ended:
            raise CheckpointError(
                f"{completions_path}:{line.lineno}: step {split[1]} of conversation {row.get('prompt_id')} after "
                f"{len(ledger.lines)} step lines{' and its outcome' if ledger.ended else ''}: steps are written "
                "once, in order"
            )
        ledger.lines.append((split[1], int(row.get("turn_index") or 0), line.offset, line.length))
        ledger.ended = row.get("outcome") is not None
    for row in read_rows(rejects_path):
        split = split_step_key(str(row.get("request_key", "")))
        if split is None or split[0] not in conversation_keys:
            foreign += 1
            continue
        ledger = ledgers[split[0]]
        if ledger.rejected_step is not None or ledger.ended or split[1] != len(ledger.lines):
            raise CheckpointError(
                f"{rejects_path}: a reject of step {split[1]} of conversation {row.get('prompt_id')}, which has "
                f"{len(ledger.lines)} step lines{', an outcome' if ledger.ended else ''}"
                f"{' and another reject' if ledger.rejected_step is not None else ''}: both completed and rejected"
            )
        ledger.rejected_step = split[1]
    if foreign:
        raise CheckpointError(
            f"{completions_path.name}/{rejects_path.name} hold {foreign} lines that are no step of a conversation "
            "of this shard under this spec and model (turns, sampling, model or template changed?); use a new "
            "namespace instead of mixing"
        )
    return dict(ledgers)


def conversation_keys(layout: RunLayout, shard_id: int, chat: ChatTokenizer, spec: RunSpec) -> dict[str, str]:
    """Each conversation's request key and its prompt id, in the shard's order (a prompt listed twice once)."""
    key_of = RequestKeys(spec.sampling, chat)
    keys: dict[str, str] = {}
    for prompt in read_prompts(layout.shard_prompts(shard_id)):
        keys.setdefault(key_of(prompt.prompt_id), prompt.prompt_id)
    return keys


def unsettled_conversations(shard_id: int, layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> int:
    """Conversations of the shard its checkpoint has not settled: 0 means the shard needs no server."""
    keys = conversation_keys(layout, shard_id, chat, spec)
    ledgers = read_ledger(layout.shard_completions(shard_id), layout.shard_rejects(shard_id), set(keys))
    return sum(1 for key in keys if key not in ledgers or not ledgers[key].settled)


def step_check(spec: RunSpec, chat: ChatTokenizer) -> StepCheck:
    """Validation's per-sample checks of one step, as the validation stage runs them (its word table included)."""
    words = word_tokens(chat)

    def check(c: Completion) -> tuple[str, str] | None:
        verdict = check_completion(c, spec.validation, spec.sampling.enable_thinking, words)
        return None if verdict.reason is None else (verdict.reason, verdict.detail)

    return check


def _line_at(path: Path, offset: int, length: int) -> Completion:
    with open(path, "rb") as f:
        f.seek(offset)
        return Completion.from_json(f.read(length).decode("utf-8"))


def expected_steps(prompt: Prompt) -> int:
    """The steps a conversation's regeneration is expected to take: each user turn's recorded steps (at least 1)."""
    try:
        script = Script.of(prompt)
    except Unsendable:
        return 1  # its first step is rejected when it opens
    return sum(max(1, len(turn.steps)) for turn in script.turns)


def pilot_step_tokens(layout: RunLayout, spec: RunSpec) -> StepTokens | None:
    """Expected tokens per step from the run's pilot, when its projection is on this box (None: steps count).

    In every-turn mode the pilot's length model predicts a conversation's whole output (tasks/pilot_turns.py),
    so a step's share is that over the conversation's expected steps.
    """
    if spec.pilot is None:
        return None
    # The pilot is a run beside this one (RunLayout.for_run); its projection is tasks.pilot.PILOT_JSON (not imported:
    # the pilot's modules build on this one).
    path = layout.root.parent / spec.pilot / "pilot.json"
    try:
        model = LengthModel.model_validate(json.loads(path.read_text(encoding="utf-8"))["length_model"])
    except (OSError, ValueError, KeyError) as exc:  # e.g. a box of a multi-box run, which has no pilot file
        logger.info("ranking conversations by steps left: no pilot length model at %s (%s)", path, exc)
        return None
    return lambda p: model.predict(p) / expected_steps(p)


def send_order(shard: int, row: int, work: float, held: int, share: int) -> tuple[int, ...]:
    """A step's place in the dispatcher's queue: within its shard's share, plan order; beyond it, most work first."""
    if held < share:
        return (0, shard, -round(work), row)
    return (1, -round(work), shard, row)


@dataclass(frozen=True, slots=True)
class _Conversation:
    prompt: Prompt
    row: int  # its line in the shard: the plan position of all its steps
    key: str  # its request key; a step's is `<key>:step-N`
    steps: int = 1  # expected steps (`expected_steps`)
    step_tokens: float = 1.0  # expected output tokens per step

    def work_left(self, step: int) -> float:
        """Expected tokens of this step and those after it."""
        return max(1, self.steps - step) * self.step_tokens


class _ShardConversations:
    """The every-turn generation of one shard: its conversations, their steps in flight, and their ledger."""

    def __init__(
        self,
        shard_id: int,
        layout: RunLayout,
        dispatcher: Dispatcher | None,
        chat: ChatTokenizer,
        spec: RunSpec,
        flush_interval_s: float,
        place: contextlib.ExitStack,
        step_tokens: StepTokens | None = None,
    ) -> None:
        self.shard_id = shard_id
        self.step_tokens = step_tokens if step_tokens is not None else pilot_step_tokens(layout, spec)
        self.place = place  # the shard's reservation of its plan order: closed once every conversation is opened
        self.completions_path, self.rejects_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        self.prompts_path = layout.shard_prompts(shard_id)
        self.dispatcher = dispatcher
        self.regen = Regenerator(preparer_for(spec, chat), step_check(spec, chat))
        self.sampling = sampling_params_for(spec.sampling)
        self.flush_interval_s = flush_interval_s
        self.key_of = RequestKeys(spec.sampling, chat)
        self.inflight: InFlight[tuple[_Conversation, Script, StepRequest]] = InFlight()
        # Next steps of conversations under way, most work left first: (rank, arrival, item).
        self.ready: list[tuple[tuple[float, int], int, tuple[_Conversation, Script, StepRequest]]] = []
        self._arrivals = itertools.count()
        self.completions: CheckpointAppender  # opened by run(), once the ledger is known to be this shard's
        self.rejects: CheckpointAppender

    def run(self) -> ShardResult:
        conversations: dict[str, _Conversation] = {}
        duplicates = 0
        for row, prompt in enumerate(read_prompts(self.prompts_path)):
            key = self.key_of(prompt.prompt_id)
            duplicates += key in conversations
            if key not in conversations:
                per_step = self.step_tokens(prompt) if self.step_tokens is not None else 1.0
                conversations[key] = _Conversation(prompt, row, key, expected_steps(prompt), max(per_step, 1e-6))
        if duplicates:
            logger.warning("shard %d: %d duplicate prompt ids are generated once", self.shard_id, duplicates)
        ledgers = read_ledger(self.completions_path, self.rejects_path, set(conversations))
        todo = [c for key, c in conversations.items() if key not in ledgers or not ledgers[key].settled]
        # Most work left first (a resumed conversation counts from its first unwritten step); plan order on ties.
        todo.sort(key=lambda c: self._rank(c, len(ledgers[c.key].lines) if c.key in ledgers else 0))
        logger.info(
            "shard %d: %d conversations, %d settled in checkpoint (%d step lines), %d to do",
            self.shard_id,
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
                with self.dispatcher.shares.sending(self.shard_id):
                    self._generate(collections.deque(todo), ledgers)
        finally:
            self.inflight.cancel()
            self.completions.close()
            self.rejects.close()
        self.inflight.check(
            self.shard_id,
            "steps",
            "every step before them is checkpointed and a retry resumes those conversations there",
        )
        return self._result(conversations)

    @staticmethod
    def _rank(conv: _Conversation, step: int) -> tuple[float, int]:
        """Most work left first, then plan order."""
        return (-conv.work_left(step), conv.row)

    def _rank_of(self, item: tuple[_Conversation, Script, StepRequest]) -> tuple[float, int]:
        return self._rank(item[0], item[2].step)

    def _generate(self, todo: collections.deque[_Conversation], ledgers: dict[str, _Ledger]) -> None:
        """Send ready steps and open conversations, most work left first, writing results as they come."""
        dispatcher = self.dispatcher
        assert dispatcher is not None  # only unsettled conversations get here, and those need servers
        opened: tuple[_Conversation, Script, StepRequest] | None = None  # prepared, waiting for room

        def opening_rank(conv: _Conversation) -> tuple[float, int]:
            return self._rank(conv, len(ledgers[conv.key].lines) if conv.key in ledgers else 0)

        while True:
            self._harvest(0)
            best = self.ready[0][0] if self.ready else None
            if opened is None and todo and (best is None or opening_rank(todo[0]) < best):
                opened = self._open_next(todo, ledgers)
                continue  # a rejected opening may have settled others meanwhile: rank again
            from_ready = bool(self.ready) and (opened is None or (best is not None and best <= self._rank_of(opened)))
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
            conv, _, req = item
            order = send_order(
                self.shard_id,
                conv.row,
                conv.work_left(req.step),
                len(self.inflight.items),
                dispatcher.shares.share(dispatcher.queue_limit),
            )
            job = GenerateJob(
                req.prompt_ids, self.sampling, label=f"{conv.prompt.prompt_id}:step-{req.step}", order=order
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
            # Its first step is in the queue: the shard's share keeps it from starving from here on, so later
            # shards may prepare theirs (the reservation only covers a late start, e.g. a long checkpoint read).
            self.place.close()

    def _open_next(
        self, todo: collections.deque[_Conversation], ledgers: dict[str, _Ledger]
    ) -> tuple[_Conversation, Script, StepRequest] | None:
        """The next conversation's next step (step 0, or where a crash left it); None when none is left."""
        assert self.dispatcher is not None
        while todo:
            conv = todo.popleft()
            with self.dispatcher.turn((self.shard_id, conv.row)):  # prepared in plan order, as the queue lets in
                ledger = ledgers.get(conv.key)
                lines = ledger.lines if ledger is not None else []
                try:
                    script = Script.of(conv.prompt)
                    req = self._resume(conv, script, lines) if lines else self.regen.first(script)
                except Unsendable as exc:
                    req = None
                    self._write_reject(conv, len(lines), exc.reason, exc.detail)
            if req is not None:
                return conv, script, req
            self.dispatcher.add_expected(-1)  # settled here, never sent
        return None

    def _resume(
        self, conv: _Conversation, script: Script, lines: list[tuple[int, int, int, int]]
    ) -> StepRequest | None:
        """The step after a conversation's last line, from its lines; None when it ends there (a reject says why)."""
        turn = lines[-1][1]
        steps = [_line_at(self.completions_path, offset, length) for _, t, offset, length in lines if t == turn]
        try:
            last = self.regen.resume(script, steps)
        except ValueError as exc:  # Unsendable too: it was sent once, so the template or model changed
            raise CheckpointError(f"{self.completions_path}: cannot resume: {exc}") from exc
        nxt = self.regen.after(script, last, steps[-1])
        if isinstance(nxt, Ended):  # its line was written as continuing, so the rules changed since: end it here
            self._write_reject(conv, len(lines), nxt.outcome, f"{nxt.detail} (decided when resuming)")
            return None
        logger.debug("conversation %s resumes at step %d", conv.prompt.prompt_id, nxt.step)
        return nxt

    def _harvest(self, timeout: float) -> None:
        """Write every finished step and queue its successor; wait up to `timeout` for the first one."""
        for outcome, item in self.inflight.finished(timeout):
            self._settle(outcome, *item)
        self.completions.sync_if_due()
        self.rejects.sync_if_due()

    def _settle(
        self, result: GenerateResult | Refused | None, conv: _Conversation, script: Script, req: StepRequest
    ) -> None:
        key = step_key(conv.key, req.step)
        if isinstance(result, Refused):
            self._write_reject(conv, req.step, result.reason, result.detail)
            return
        if result is None:  # not about this step (InFlight.failures): left unsettled, a shard retry resumes here
            return
        c = completion_record(conv.prompt, key, len(req.prompt_ids), result, conv.row)
        assert self.dispatcher is not None
        try:
            with self.dispatcher.turn((self.shard_id, conv.row)):
                nxt = self.regen.after(script, req, c)
        except Unsendable as exc:  # the next user turn cannot be rendered: its reject ends the conversation
            self.completions.write(step_record(c, req).to_json())
            self._write_reject(conv, req.step + 1, exc.reason, exc.detail)
            return
        if isinstance(nxt, Ended):
            self.completions.write(step_record(c, req, nxt).to_json())
            return
        self.completions.write(step_record(c, req).to_json())
        kill_point("generate.mid-conversation")
        self.dispatcher.add_expected(1)
        heapq.heappush(self.ready, (self._rank(conv, nxt.step), next(self._arrivals), (conv, script, nxt)))

    def _write_reject(self, conv: _Conversation, step: int, reason: str, detail: str) -> None:
        where = f"conversation {conv.prompt.prompt_id}, step {step}: {detail}"
        self.rejects.write(generation_reject(conv.prompt, step_key(conv.key, step), reason, where).to_json())

    def _result(self, conversations: dict[str, _Conversation]) -> ShardResult:
        ledgers = read_ledger(self.completions_path, self.rejects_path, set(conversations))
        open_ = [key for key in conversations if key not in ledgers or not ledgers[key].settled]
        if open_:
            raise CheckpointError(f"shard {self.shard_id}: {len(open_)} conversations neither ended nor rejected")
        return shard_result(
            self.shard_id, self.completions_path, self.rejects_path, len(conversations), self.inflight.n_sent
        )


def generate_conversations(
    shard_id: int,
    layout: RunLayout,
    dispatcher: Dispatcher | None,
    chat: ChatTokenizer,
    spec: RunSpec,
    flush_interval_s: float,
    place: contextlib.ExitStack,
    step_tokens: StepTokens | None = None,
) -> ShardResult:
    """Generate every conversation of one shard its checkpoint has not settled, each step once; counts in
    `ShardResult` are conversations (`n_prompts`), step lines (`n_completed`) and reject lines (`n_rejected`).

    `place` holds the shard's plan order (generate_shard's reservation) until its first step is in the dispatcher's
    queue. `step_tokens`: each conversation's expected tokens per step, for ranking by work left (None: the run's
    pilot's length model when its projection is on this box, else each step counts 1)."""
    return _ShardConversations(shard_id, layout, dispatcher, chat, spec, flush_interval_s, place, step_tokens).run()
