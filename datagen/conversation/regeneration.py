"""Every-turn regeneration: a conversation's script, and what follows each generated step (pure logic, no I/O).

In `turns: every` mode (docs/conversations.md, "Every turn: the engine") the target writes every assistant turn
of a conversation in order, conditioned on its own earlier answers. The row's recorded assistant content is
discarded; what the row keeps is its **script**:

    head     the system messages before the first user query (kept as given)
    turns    per user turn: the messages that open it (the query), then its recorded assistant steps, each with
             the names of the functions it called, in order, and the tool results recorded after it

`Regenerator.first` is a conversation's first request (head + user turn 0, rendered fresh by the run's
`Preparer`); `Regenerator.after` takes the step that request produced and returns the next request or how the
conversation `Ended`:

- the model called the recorded functions (same count, same names in order) and results were recorded: the
  results are spliced after its turn and the same user turn continues, **token-exact**: the next prompt is the
  previous prompt's ids + the output ids + `bridge_ids` (the ids of what the template writes between, i.e. the
  tool turns and the generation prompt);
- the model answered in words where the recorded step did: the next user turn opens, rendered fresh (the
  template drops the reasoning of turns before the last query, so no continuation exists across user turns);
- otherwise the conversation ends with one of `OUTCOMES` on this step (what was generated is kept), or with
  `rejected_<reason>` when the step fails the run's per-sample check (`StepCheck`: a placeholder, a loop).

`Regenerator.resume` rebuilds a step's request from the conversation's checkpoint lines, so a rerun decides what
follows a conversation's last written step exactly as the run that wrote it would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from datagen.chat import TemplateError
from datagen.conversation.export import assistant_turn, assistant_view
from datagen.conversation.segments import cut_outcome
from datagen.conversation.toolcalls import answer_text, parse_tool_calls
from datagen.records import STEP_KEY_SEPARATOR, Completion, Message, Prompt, ToolCall, split_step_key
from datagen.sources.preparation import Preparer, Unsendable

__all__ = [
    "COMPLETE",
    "CONTEXT_EXCEEDED",
    "OUTCOMES",
    "RENDER_MISMATCH",
    "STEP_KEY_SEPARATOR",
    "TOOL_CALL_DIVERGENCE",
    "TOOL_CALL_MISSING",
    "TRUNCATED",
    "UNEXPECTED_TOOL_CALL",
    "Ended",
    "RecordedStep",
    "Regenerator",
    "Script",
    "StepCheck",
    "StepRequest",
    "UserTurn",
    "follows",
    "is_query",
    "split_step_key",
    "step_key",
    "step_record",
]

# Why a conversation ended: the `outcome` of its last step line.
COMPLETE = "complete"  # every user turn answered
TRUNCATED = "truncated"  # the step stopped at the token limit (finish `length`) or was aborted: nothing follows it
TOOL_CALL_DIVERGENCE = "tool_call_divergence"  # it called other functions, or another number, than recorded
TOOL_CALL_MISSING = "tool_call_missing"  # the recorded step called functions, the model answered in words
UNEXPECTED_TOOL_CALL = "unexpected_tool_call"  # it called where the recorded step answered, or no results remain
CONTEXT_EXCEEDED = "context_exceeded"  # the next request would not fit (prompt + max_new_tokens > context)
RENDER_MISMATCH = "render_mismatch"  # the template's render of the longer history does not extend what was sent
# Besides these, `rejected_<reason>`: the step failed a per-sample check (a placeholder, a loop; `StepCheck`).
OUTCOMES = frozenset(
    {
        COMPLETE,
        TRUNCATED,
        TOOL_CALL_DIVERGENCE,
        TOOL_CALL_MISSING,
        UNEXPECTED_TOOL_CALL,
        CONTEXT_EXCEEDED,
        RENDER_MISMATCH,
    }
)

# A per-sample check of a generated step (datagen.checks.quality's, as validation runs it): (reason, detail) when
# it fails.
StepCheck = Callable[[Completion], tuple[str, str] | None]

_TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


def step_key(conversation_key: str, step: int) -> str:
    """The request key of step `step` of the conversation whose request key is `conversation_key`."""
    return f"{conversation_key}{STEP_KEY_SEPARATOR}{step}"


def follows(before: Completion, after: Completion, enable_thinking: bool) -> bool:
    """Whether step line `after` was requested after step line `before`: its history's assistant turns are
    `before`'s plus `before`'s own generated turn (what tokenization verifies of a conversation's steps)."""
    earlier = [assistant_view(m) for m in before.messages if m.role == "assistant"]
    held = [assistant_view(m) for m in after.messages if m.role == "assistant"]
    return held == [*earlier, assistant_view(assistant_turn(before, enable_thinking))]


def is_query(m: Message) -> bool:
    """A user message the template counts as a query: not `<tool_response>...</tool_response>` text (trimmed)."""
    text = m.text.strip()
    return m.role == "user" and not (text.startswith(_TOOL_RESPONSE[0]) and text.endswith(_TOOL_RESPONSE[1]))


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One recorded assistant turn: the functions it called (names, in order) and the results recorded after it."""

    calls: tuple[str, ...]
    results: tuple[Message, ...] = ()
    call_ids: tuple[str | None, ...] = ()  # the recorded calls' own ids (OpenAI `tool_calls[i].id`), when given


@dataclass(frozen=True, slots=True)
class UserTurn:
    """The messages opening a user turn (its query) and the recorded assistant steps answering it."""

    opening: tuple[Message, ...]
    steps: tuple[RecordedStep, ...] = ()


@dataclass(frozen=True, slots=True)
class Script:
    """What a conversation's regeneration follows; the recorded assistant content is not part of it."""

    head: tuple[Message, ...]
    turns: tuple[UserTurn, ...]
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, prompt: Prompt) -> Script:
        """The script of a loaded conversation (the loader already dropped its trailing assistant reply).

        - A user message that is `<tool_response>` text is not a query (the template's rule): after an assistant
          turn it is one of that turn's results, like a `tool` message; before any, part of the turn's opening.
        - A query right after another (no assistant turn between) joins that turn's opening.
        - A recorded step's calls are its `tool_calls`, else calls written in its content in Qwen3.6's format.
        - Messages before the first query other than system ones (an assistant greeting, its results) are left
          out: no query asks for them. A user turn without recorded steps (the last one, whose reply was
          dropped) is answered like one that answered in words.
        """
        head: list[Message] = []
        openings: list[list[Message]] = []  # per user turn
        # Per user turn: (calls, results, call ids) per recorded step.
        recorded: list[list[tuple[tuple[str, ...], list[Message], tuple[str | None, ...]]]] = []
        for m in prompt.messages:
            answered = bool(recorded and recorded[-1])  # the current user turn has a recorded step
            if is_query(m) and (answered or not openings):
                openings.append([m])
                recorded.append([])
            elif not openings:  # before the first query
                if m.role in ("system", "user"):
                    head.append(m)
            elif m.role == "assistant":
                recorded[-1].append((_recorded_calls(m), [], tuple(c.id for c in m.tool_calls or ())))
            elif answered:
                recorded[-1][-1][1].append(m)  # a result of the last recorded step
            else:
                openings[-1].append(m)  # a second query, or results text before any step: the turn's opening
        if not openings:
            raise Unsendable("template_error", "the conversation has no user query to answer")
        return cls(
            head=tuple(head),
            turns=tuple(
                UserTurn(
                    tuple(opening),
                    tuple(RecordedStep(calls, tuple(results), ids) for calls, results, ids in steps),
                )
                for opening, steps in zip(openings, recorded, strict=True)
            ),
            tools=prompt.tools,
        )

    def recorded_view(self) -> list[Message]:
        """What a regeneration takes from the recording, as messages: the head, each user turn's opening and, per
        recorded step, an assistant turn that holds only the names of the functions it called (no text, no
        reasoning, no arguments: the model writes its own) followed by the results recorded after it.

        Two conversations with the same view are regenerated alike: the recorded assistant text that every turn
        discards, and the messages before the first query it leaves out, are not in it (datagen.identity hashes it).
        """
        out: list[Message] = list(self.head)
        for turn in self.turns:
            out.extend(turn.opening)
            for step in turn.steps:
                calls = tuple(ToolCall(name=name, arguments={}) for name in step.calls) or None
                out.append(Message(role="assistant", content="", tool_calls=calls))
                out.extend(step.results)
        return out


def _recorded_calls(m: Message) -> tuple[str, ...]:
    if m.tool_calls:
        return tuple(c.name for c in m.tool_calls)
    return tuple(c.name for c in parse_tool_calls(answer_text(m.text)))


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One generation to request: the history it is conditioned on and the exact ids sent."""

    step: int  # 0-based within the conversation
    turn_index: int  # the user turn it answers
    recorded: int  # which recorded step of that turn it stands for
    messages: list[Message] = field(repr=False)
    prompt_ids: list[int] = field(repr=False)
    bridge_ids: list[int] | None = field(default=None, repr=False)  # a continuation's ids after the previous output


@dataclass(frozen=True, slots=True)
class Ended:
    """The conversation ends on the step just generated: its outcome and, in words, why."""

    outcome: str
    detail: str


def step_record(c: Completion, req: StepRequest, ended: Ended | None = None) -> Completion:
    """The checkpoint line of a step: the completion with the request's history, ids count and step fields."""
    meta = {**c.meta, "outcome_detail": ended.detail} if ended is not None else c.meta
    return replace(
        c,
        messages=list(req.messages),
        prompt_tokens=len(req.prompt_ids),
        meta=meta,
        step=req.step,
        turn_index=req.turn_index,
        bridge_ids=req.bridge_ids,
        outcome=ended.outcome if ended is not None else None,
    )


class Regenerator:
    """The every-turn state machine over the run's request preparation (template, thinking, prompt budget)."""

    def __init__(self, preparer: Preparer, check: StepCheck | None = None) -> None:
        self.preparer = preparer
        self.chat = preparer.chat
        # Validation cuts a conversation at its first failing step anyway: generating past one is wasted.
        self.check = check

    def first(self, script: Script) -> StepRequest:
        """Step 0: the head and user turn 0, rendered fresh; raises Unsendable (the conversation's reject)."""
        messages = [*script.head, *script.turns[0].opening]
        return StepRequest(0, 0, 0, messages, self.preparer(messages, script.tools))

    def after(self, script: Script, req: StepRequest, c: Completion) -> StepRequest | Ended:
        """What follows the step `c` that `req` produced: the next request, or how the conversation ends.

        Raises Unsendable when the next user turn cannot be rendered for a reason other than its length
        (a template error): the next step's reject row then ends the conversation.
        """
        turn = script.turns[req.turn_index]
        recorded = turn.steps[req.recorded] if req.recorded < len(turn.steps) else None
        made = tuple(call.name for call in c.tool_calls or ())
        if c.finish_reason != "stop":
            return Ended(TRUNCATED, f"finish {c.finish_reason} after {len(c.output_ids)} tokens")
        failed = self.check(c) if self.check is not None else None
        if failed is not None:
            return Ended(cut_outcome(failed[0]), failed[1])
        history = [*req.messages, assistant_turn(c, self.preparer.enable_thinking, req.step)]
        if made:
            if recorded is None or not recorded.calls:
                said = "answered in words" if recorded is not None else "recorded no further step"
                return Ended(UNEXPECTED_TOOL_CALL, f"called {_names(made)} where the recorded turn {said}")
            if made != recorded.calls:
                return Ended(TOOL_CALL_DIVERGENCE, f"called {_names(made)}, the recorded turn {_names(recorded.calls)}")
            if not recorded.results:
                return Ended(UNEXPECTED_TOOL_CALL, f"called {_names(made)}; no recorded results follow that call")
            turn_with_ids, results = paired_calls(history[-1], recorded)
            return self._continuation(script, req, c, [*history[:-1], turn_with_ids, *results])
        if recorded is not None and recorded.calls:
            return Ended(TOOL_CALL_MISSING, f"answered in words, the recorded turn called {_names(recorded.calls)}")
        if req.turn_index + 1 == len(script.turns):
            return Ended(COMPLETE, f"all {len(script.turns)} user turns answered")
        history.extend(script.turns[req.turn_index + 1].opening)
        try:
            ids = self.preparer(history, script.tools)
        except Unsendable as exc:
            if exc.reason == "prompt_too_long":
                return Ended(CONTEXT_EXCEEDED, f"user turn {req.turn_index + 1}: {exc.detail}")
            raise
        return StepRequest(req.step + 1, req.turn_index + 1, 0, history, ids)

    def _continuation(
        self, script: Script, req: StepRequest, c: Completion, history: list[Message]
    ) -> StepRequest | Ended:
        """The same user turn after the spliced results: previous prompt + output + the template's bridge."""
        chat, thinking = self.chat, self.preparer.enable_thinking
        try:
            sent = chat.render(req.messages, thinking, script.tools) + chat.decode(c.output_ids)
            text = chat.render(history, thinking, script.tools)
        except TemplateError as exc:
            raise Unsendable("template_error", f"the chat template refused the continuation: {exc}") from exc
        if not text.startswith(sent):
            at = next(
                (i for i, (x, y) in enumerate(zip(sent, text, strict=False)) if x != y), min(len(sent), len(text))
            )
            return Ended(
                RENDER_MISMATCH,
                f"the template renders the history differently from what was sent and generated, from character "
                f"{at}: {text[at : at + 40]!r} where {sent[at : at + 40]!r} was",
            )
        bridge_text = text[len(sent) :]
        bridge = chat.encode(bridge_text)
        if chat.decode(bridge) != bridge_text:
            return Ended(RENDER_MISMATCH, f"the text between the turns does not round-trip: {bridge_text[:80]!r}")
        ids = [*req.prompt_ids, *c.output_ids, *bridge]
        if len(ids) > self.preparer.token_limit:
            return Ended(
                CONTEXT_EXCEEDED,
                f"the continuation has {len(ids)} prompt tokens, limit is {self.preparer.token_limit} "
                f"{self.preparer.limit_note}".rstrip(),
            )
        return StepRequest(req.step + 1, req.turn_index, req.recorded + 1, history, ids, bridge)

    def resume(self, script: Script, steps: Sequence[Completion]) -> StepRequest:
        """The request that produced the last of a conversation's step lines (in step order), rebuilt token-exact.

        Its history is the line's; its ids the fresh render of its user turn's first step, then each step's output
        and the next one's bridge. Raises ValueError when they do not add up to what the line says was sent.
        """
        last = steps[-1]
        turn = [s for s in steps if s.turn_index == last.turn_index]
        ids = self.preparer(turn[0].messages, script.tools)
        for before, s in pairwise(turn):
            ids = [*ids, *before.output_ids, *(s.bridge_ids or ())]
        if len(ids) != last.prompt_tokens:
            raise ValueError(
                f"step {last.step} of conversation {last.prompt_id}: its prompt rebuilt from the checkpoint has "
                f"{len(ids)} tokens, the line says {last.prompt_tokens} were sent"
            )
        return StepRequest(last.step, last.turn_index, len(turn) - 1, list(last.messages), ids, last.bridge_ids)


def paired_calls(turn: Message, recorded: RecordedStep) -> tuple[Message, tuple[Message, ...]]:
    """The model's calling turn and the recorded results spliced after it, their OpenAI ids paired.

    The model's calls (the same functions as recorded, in order) take the recorded calls' ids, else the ids the
    recorded results answer (`tool_call_id`), else keep theirs (`assistant_turn` gives each one); a recorded `tool`
    result without a `tool_call_id` then answers the call at its place. A consumer that pairs calls and results by
    id finds each result's call (issue 47: the regenerated calls had no ids, the results the recorded ones).
    """
    calls = list(turn.tool_calls or ())
    tools = [m for m in recorded.results if m.role == "tool"]
    paired_by_result = len(tools) == len(calls)
    for i, call in enumerate(calls):
        recorded_id = recorded.call_ids[i] if i < len(recorded.call_ids) else None
        answered = tools[i].tool_call_id if paired_by_result else None
        if recorded_id is not None or answered is not None:
            calls[i] = replace(call, id=recorded_id if recorded_id is not None else answered)
    results = list(recorded.results)
    if paired_by_result:
        k = 0
        for j, m in enumerate(results):
            if m.role == "tool":
                if m.tool_call_id is None:
                    results[j] = replace(m, tool_call_id=calls[k].id)
                k += 1
    return replace(turn, tool_calls=tuple(calls) or None), tuple(results)


def _names(calls: tuple[str, ...]) -> str:
    return ", ".join(calls) if calls else "no function"
