"""The turn mode: which steps of a conversation are generated, their keys, records and place in the queue.

One policy per `RunSpec.turns`, chosen once (`turn_mode`); the shard driver (tasks/generation.py) asks it and
never the spec:

    last    the recorded conversation is the history (planning's render of it is sent as is); its last reply is
            generated: one step, keyed by the conversation's request key, written as the server returned it.
            The plan order is the schedule: planning already ranked the prompts, and nothing changes during the
            run, so a shard keeps its plan-order reservation until every conversation is in the queue.
    every   each assistant turn is generated in order (datagen.conversation.regeneration): step N is keyed
            `<key>:step-N`, its line carries the step fields, and a step that stops at the token limit (or fails
            validation's per-sample check) ends the conversation. Work left is the schedule: it changes as steps
            finish, so a shard releases its reservation once its first step is queued and ranks steps by work
            left; a shard holding no request goes first, so none starves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from datagen.chat import ChatTokenizer, Tools
from datagen.checks.quality import check_completion
from datagen.checks.repetition import word_tokens
from datagen.conversation.regeneration import (
    COMPLETE,
    Ended,
    Regenerator,
    Script,
    StepCheck,
    StepRequest,
    split_step_key,
    step_key,
    step_record,
)
from datagen.conversation.turn_stats import StepTail, TurnCounts
from datagen.records import Completion, Message, Prompt
from datagen.runspec import RunSpec
from datagen.sources.preparation import Preparer, RenderedIds, Unsendable, preparer_for, read_rendered

__all__ = [
    "Conversation",
    "EveryTurn",
    "LastTurn",
    "Steps",
    "TurnMode",
    "expected_steps",
    "step_check",
    "turn_mode",
    "work_left",
]


_Lengths = TypeVar("_Lengths")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One prompt of a shard as the driver generates it."""

    prompt: Prompt
    row: int  # its line in the shard: the plan position of all its steps
    key: str  # its request key; a step's key is the mode's `step_key(key, step)`
    # Expected output tokens of each step it is expected to take (`TurnMode.expected_steps` of them), in order.
    expected: tuple[float, ...] = (1.0,)

    def work_left(self, step: int) -> float:
        """Expected tokens of this step and those after it (`work_left`: the rank the driver sends by)."""
        return work_left(self.expected, step)


class Steps(ABC):
    """One shard's stepping under a mode: a conversation's first step, what follows a step, and its record."""

    @abstractmethod
    def first(self, conv: Conversation) -> StepRequest:
        """Step 0's request; raises Unsendable (the conversation's reject)."""

    @abstractmethod
    def resume(self, conv: Conversation, lines: Sequence[Completion]) -> StepRequest:
        """The request that produced the last of a conversation's step lines (those of its last user turn);
        raises ValueError when the lines do not rebuild it."""

    @abstractmethod
    def after(self, conv: Conversation, req: StepRequest, c: Completion) -> StepRequest | Ended:
        """The next step's request, or how the conversation ends; raises Unsendable (the next step's reject)."""

    @abstractmethod
    def record(self, c: Completion, req: StepRequest, ended: Ended | None) -> Completion:
        """The checkpoint line of the step `req` produced (`c`: the server's result as a completion)."""


class TurnMode(ABC):
    """A run's turn mode (module docstring); stateless, one instance per mode."""

    name: ClassVar[Literal["last", "every"]]
    continues: ClassVar[bool]  # a step can follow a conversation's first (its successor is prepared on the turn)
    # The schedule ranks conversations by their expected work left (else the plan order is the rank).
    ranked_by_work: ClassVar[bool]
    # What settles in this mode, as live progress and the progress artifact name it ("<label>, of <planned>").
    progress_label: ClassVar[str]
    # The tail of a shard's generation cache key (datagen.identity.generation_cache_key): `last` keys are what they
    # always were; `every` shards hold other lines (steps) than `last` ones of the same plan.
    cache_tag: ClassVar[str]
    # The unit two writers' rows of one shard are merged by (a multi-box run's parts, tasks/shard_exchange.py): the
    # request key (a conversation is one line) or the conversation (a chain of step lines, each following the last).
    merge_unit: ClassVar[Literal["request", "conversation"]]
    # The recorded assistant replies never reach the model (every turn writes its own): an empty or null one is no
    # reason to refuse a conversation at load (datagen.sources.prompts).
    discards_recorded_replies: ClassVar[bool]

    @abstractmethod
    def step_key(self, key: str, step: int) -> str:
        """The request key of step `step` of the conversation keyed `key`."""

    @abstractmethod
    def split_key(self, key: str) -> tuple[str, int] | None:
        """(conversation key, step) of a checkpoint row's key; None for a key this mode never writes."""

    @abstractmethod
    def ends(self, row: dict[str, Any]) -> bool:
        """Whether a step line (a checkpoint row) is the last of its conversation."""

    @abstractmethod
    def expected_steps(self, prompt: Prompt) -> int:
        """The steps a conversation is expected to take."""

    @abstractmethod
    def send_order(self, shard: int, row: int, work: float, held: int) -> tuple[int, ...]:
        """A step's place in the dispatcher's queue (`work`: its conversation's work left; `held`: the shard's
        requests in flight: queued, at a server or running)."""

    @abstractmethod
    def steps(self, spec: RunSpec, chat: ChatTokenizer, prompts_path: Path) -> Steps:
        """The stepping of one shard whose prompts are `prompts_path` (made once it has a conversation to open)."""

    @abstractmethod
    def reject_detail(self, conv: Conversation, step: int, detail: str) -> str:
        """The detail of the reject row that ends a conversation at `step`."""

    @abstractmethod
    def conversation_of(self, c: Completion) -> str | None:
        """The conversation a checkpoint line is gathered into with the lines of its other steps (validation,
        tokenization); None: the line is a conversation of one step on its own."""

    @abstractmethod
    def plan_step(self, request_key: str) -> int | None:
        """The step a checkpoint line with this request key takes in its conversation, to order a shard's lines
        (tasks/validation.py); None: the line is ordered on its own, by its plan position."""

    @property
    def holds_place_until_open(self) -> bool:
        """The shard keeps its plan-order reservation until every conversation is open (else: its first step)."""
        return not self.continues

    def ranking_lengths(self, lengths: Callable[[], _Lengths]) -> _Lengths | None:
        """The expected step lengths the schedule ranks conversations by (`lengths()`, read only where the mode
        ranks by work left); None: the plan order is the rank."""
        return lengths() if self.ranked_by_work else None

    def affinity(self, key: str) -> str:
        """The dispatcher's affinity of a step of the conversation keyed `key`: the conversation where a later step
        reuses an earlier one's prefix (its server's radix cache holds it), else none."""
        return key if self.continues else ""

    def preparing_next(self, turn: AbstractContextManager[None]) -> AbstractContextManager[None]:
        """What a conversation's next step is prepared under: the plan-order `turn` where one can follow (it is
        rendered there, in plan order), else nothing."""
        return turn if self.continues else nullcontext()

    def first_step_queued(self, place: ExitStack) -> None:
        """A conversation's first step is in the dispatcher's queue: release the shard's plan-order `place` unless
        the shard keeps it until every conversation is open."""
        if not self.holds_place_until_open:
            place.close()

    @abstractmethod
    def identity_preparers(self, spec: RunSpec, chat: ChatTokenizer) -> tuple[Preparer, Preparer | None]:
        """(the recorded conversation's render, checked against the budget it must fit; the first request's when it
        is another): datagen.identity.PromptIdentity."""

    @abstractmethod
    def identity_messages(self, messages: list[Message], tools: Tools) -> list[Message]:
        """What the target is asked to continue, as messages: the part of a recorded conversation this mode sends
        to the model (a prompt's id hashes its render, datagen.identity); raises Unsendable when it has none."""

    @abstractmethod
    def step_tail(self, completions: Sequence[Path], rejects: Sequence[Path], planned: int) -> StepTail | None:
        """Conversations and steps counted over these checkpoint files as they grow; None where a prompt is one
        line (its progress is the dispatcher's count)."""

    def conversation_counts(
        self,
        completions: Sequence[Path],
        rejects: Sequence[Path],
        planned: int,
        outcomes: Mapping[str, int] | None = None,
    ) -> TurnCounts | None:
        """The conversations and steps these checkpoint files hold now (the manifest's `conversations` block, the
        run report); None where a prompt is one line (a `last` run's manifest and report have none). `outcomes`:
        the conversations by outcome as published (validation's and tokenization's cuts included), which then
        replace the generation's."""
        tail = self.step_tail(completions, rejects, planned)
        if tail is None:
            return None
        counts = tail.poll()
        return counts if not outcomes else replace(counts, outcomes=dict(outcomes))


class LastTurn(TurnMode):
    """`turns: last`: the recorded conversation is the history; its last reply is the one step generated."""

    name = "last"
    continues = False
    ranked_by_work = False  # planning ranked the prompts already, and one step's work does not change
    progress_label = "prompts with a result"
    cache_tag = ""
    merge_unit = "request"
    discards_recorded_replies = False  # the recorded history is the prompt, replies included

    def step_key(self, key: str, step: int) -> str:
        return key

    def split_key(self, key: str) -> tuple[str, int] | None:
        return None if split_step_key(key) is not None else (key, 0)

    def ends(self, row: dict[str, Any]) -> bool:
        return True

    def expected_steps(self, prompt: Prompt) -> int:
        return 1

    def send_order(self, shard: int, row: int, work: float, held: int) -> tuple[int, ...]:
        return (shard, row)  # the plan's order: planning ranked the prompts already

    def steps(self, spec: RunSpec, chat: ChatTokenizer, prompts_path: Path) -> Steps:
        prepare = preparer_for(spec, chat)
        # Planning's render of these prompts (None: render here, e.g. a shard fetched by a box of a multi-box run).
        rendered = read_rendered(prompts_path, prepare.render_key)
        return _LastSteps(prepare, rendered)

    def reject_detail(self, conv: Conversation, step: int, detail: str) -> str:
        return detail

    def identity_preparers(self, spec: RunSpec, chat: ChatTokenizer) -> tuple[Preparer, Preparer | None]:
        return preparer_for(spec, chat), None  # the prompt as recorded is the request

    def identity_messages(self, messages: list[Message], tools: Tools) -> list[Message]:
        return messages  # the recorded conversation, its replies included, is what the model continues

    def step_tail(self, completions: Sequence[Path], rejects: Sequence[Path], planned: int) -> StepTail | None:
        return None

    def conversation_of(self, c: Completion) -> str | None:
        return None  # the recorded conversation's one generated reply

    def plan_step(self, request_key: str) -> int | None:
        return None


class EveryTurn(TurnMode):
    """`turns: every`: every assistant turn is generated in order, conditioned on the model's own earlier ones."""

    name = "every"
    continues = True
    ranked_by_work = True  # a conversation's work left shrinks as its steps finish
    progress_label = "conversations finished"
    cache_tag = "-turns-every"
    merge_unit = "conversation"
    discards_recorded_replies = True

    def step_key(self, key: str, step: int) -> str:
        return step_key(key, step)

    def split_key(self, key: str) -> tuple[str, int] | None:
        return split_step_key(key)

    def ends(self, row: dict[str, Any]) -> bool:
        return row.get("outcome") is not None

    def expected_steps(self, prompt: Prompt) -> int:
        return expected_steps(prompt)

    def send_order(self, shard: int, row: int, work: float, held: int) -> tuple[int, ...]:
        # Most work left first across shards; a shard holding nothing goes first, in plan order, so every shard
        # keeps a request in flight (none starves). A larger guarantee (each shard's share of the queue, until
        # 2026-12-07) held the ranking back where it counts most, as the run drains: benchmarks/README.md.
        if held == 0:
            return (0, shard, -round(work), row)
        return (1, -round(work), shard, row)

    def steps(self, spec: RunSpec, chat: ChatTokenizer, prompts_path: Path) -> Steps:
        # Step 0 is rendered fresh: planning's render is of the whole row, not of the first user turn.
        return _EverySteps(Regenerator(preparer_for(spec, chat), step_check(spec, chat)))

    def reject_detail(self, conv: Conversation, step: int, detail: str) -> str:
        return f"conversation {conv.prompt.prompt_id}, step {step}: {detail}"

    def identity_preparers(self, spec: RunSpec, chat: ChatTokenizer) -> tuple[Preparer, Preparer | None]:
        # The id hashes the whole recorded conversation, bounded by the context; the first request must fit the
        # prompt budget (PromptIdentity's docstring says why).
        whole = Preparer(
            chat,
            spec.sampling.enable_thinking,
            spec.context_length,
            f"(turns: every; the conversation as recorded must fit the model's context_length {spec.context_length})",
        )
        return whole, preparer_for(spec, chat)

    def identity_messages(self, messages: list[Message], tools: Tools) -> list[Message]:
        # The system prompt, the user turns and the recorded tool rounds (names and results), not the replies.
        return Script.of(
            Prompt(prompt_id="", source="", row=0, messages=messages, tools=_listed(tools))
        ).recorded_view()

    def step_tail(self, completions: Sequence[Path], rejects: Sequence[Path], planned: int) -> StepTail | None:
        return StepTail(completions, rejects, planned=planned)

    def conversation_of(self, c: Completion) -> str | None:
        # A line whose key this mode never writes (e.g. left by a `last` run) stands alone, never cutting another.
        return c.prompt_id if split_step_key(c.request_key) is not None else None

    def plan_step(self, request_key: str) -> int | None:
        split = split_step_key(request_key)
        return None if split is None else split[1]


_MODES: dict[str, TurnMode] = {"last": LastTurn(), "every": EveryTurn()}


def turn_mode(spec: RunSpec) -> TurnMode:
    """The run's turn mode, from its spec: the one place that reads `spec.turns` for generation."""
    return _MODES[spec.turns]


def expected_steps(prompt: Prompt) -> int:
    """The steps a conversation's every-turn regeneration is expected to take: each user turn's recorded steps
    (at least 1)."""
    try:
        script = Script.of(prompt)
    except Unsendable:
        return 1  # its first step is rejected when it opens
    return sum(max(1, len(turn.steps)) for turn in script.turns)


def work_left(expected: Sequence[float], step: int) -> float:
    """A conversation's expected output tokens from step `step` on: its expected steps' lengths from there, summed.

    Past the expected steps it is 0. `expected_steps` counts each user turn's recorded steps, so only answers the
    recording lacks (the one after a turn's last tool results, where the recording stops at them) take a
    conversation past its count, at its end. Ranked 0, such a step goes after every conversation with recorded
    work left, which may still run long, and fills slots near the end that would otherwise wait (counting it as
    one more of the last step made the tools workload's bound 2-4% slower: benchmarks/README.md, conversations).
    The shard driver ranks by this; the chain bound's `expected_work_left` policy (tasks/chains.py) and the
    pilot's projection simulate the same rank.
    """
    return float(sum(expected[step:]))


def step_check(spec: RunSpec, chat: ChatTokenizer) -> StepCheck:
    """Validation's per-sample checks of one step, as the validation stage runs them (its word table included)."""
    words = word_tokens(chat)

    def check(c: Completion) -> tuple[str, str] | None:
        verdict = check_completion(c, spec.validation, spec.sampling.enable_thinking, words)
        return None if verdict.reason is None else (verdict.reason, verdict.detail)

    return check


class _LastSteps(Steps):
    def __init__(self, preparer: Preparer, rendered: RenderedIds | None) -> None:
        self.preparer = preparer
        self.rendered = rendered

    def first(self, conv: Conversation) -> StepRequest:
        prompt = conv.prompt
        if self.rendered is not None:
            ids = self.preparer.fitting(self.rendered[conv.row])
        else:
            ids = self.preparer(prompt.messages, prompt.tools)
        return StepRequest(0, 0, 0, prompt.messages, ids)

    def resume(self, conv: Conversation, lines: Sequence[Completion]) -> StepRequest:
        raise ValueError(f"conversation {conv.prompt.prompt_id}: a `last` conversation's one line ends it")

    def after(self, conv: Conversation, req: StepRequest, c: Completion) -> StepRequest | Ended:
        return Ended(COMPLETE, "the recorded conversation's last reply generated")

    def record(self, c: Completion, req: StepRequest, ended: Ended | None) -> Completion:
        return c  # exactly as the server returned it, under the recorded history


class _EverySteps(Steps):
    def __init__(self, regen: Regenerator) -> None:
        self.regen = regen
        self.scripts: dict[str, Script] = {}  # of the conversations under way

    def _script(self, conv: Conversation) -> Script:
        script = self.scripts.get(conv.key)
        if script is None:
            script = self.scripts[conv.key] = Script.of(conv.prompt)
        return script

    def first(self, conv: Conversation) -> StepRequest:
        return self.regen.first(self._script(conv))

    def resume(self, conv: Conversation, lines: Sequence[Completion]) -> StepRequest:
        return self.regen.resume(self._script(conv), lines)

    def after(self, conv: Conversation, req: StepRequest, c: Completion) -> StepRequest | Ended:
        try:
            nxt = self.regen.after(self._script(conv), req, c)
        except Unsendable:
            self.scripts.pop(conv.key, None)
            raise
        if isinstance(nxt, Ended):
            self.scripts.pop(conv.key, None)
        return nxt

    def record(self, c: Completion, req: StepRequest, ended: Ended | None) -> Completion:
        return step_record(c, req, ended)


def _listed(tools: Tools) -> list[dict[str, Any]] | None:
    return None if tools is None else [dict(t) for t in tools]
