"""Every-turn conversations after generation: steps grouped by conversation and user turn, and where one is cut.

A conversation's checkpoint lines (`Completion` with `step` set, docs/conversations.md) are its steps; the steps
answering user turn k are segment k, the unit of one training row. A conversation is cut at its first failing
step: the segments before stay, the failing segment and everything after it become reject rows. Pure logic:
tasks/validation.py and tasks/tokenization.py read and write the files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from datagen.records import Completion, split_step_key

__all__ = [
    "CUT_META_KEY",
    "EARLIER_TURN_REJECTED",
    "ENDED_BY_REJECT_META_KEY",
    "MISSING_STEP",
    "Segment",
    "conversations",
    "cut_outcome",
    "ending_verdict",
    "rejected_turn",
    "segments",
    "unreached_turn_detail",
    "where",
]

# Reject reasons of this module (stage validate): a segment after the turn that cut its conversation, and a
# conversation whose steps do not follow 0, 1, 2, ... (a step line lost or rejected by generation).
EARLIER_TURN_REJECTED = "earlier_turn_rejected"
MISSING_STEP = "missing_step"
_REJECTED_PREFIX = "rejected_"
# Where validation records, on the last step it keeps of a cut conversation, the outcome it ended with.
CUT_META_KEY = "conversation_cut"
# ... and, on the last step of a conversation a generation reject ended (its next step was refused), that reason.
ENDED_BY_REJECT_META_KEY = "ended_by_reject"


def cut_outcome(reason: str) -> str:
    """The outcome of a conversation cut for `reason` (docs/conversations.md's outcome names)."""
    return "truncated" if reason == "truncated" else f"{_REJECTED_PREFIX}{reason}"


@dataclass(frozen=True, slots=True)
class Segment:
    """The steps answering one user turn, in step order."""

    turn_index: int
    steps: tuple[Completion, ...]

    @property
    def conversation_id(self) -> str:
        return self.steps[0].prompt_id

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.steps)


def where(c: Completion) -> str:
    """'conversation X, turn k, step s': the words every per-turn reject's detail starts with."""
    return f"conversation {c.prompt_id}, turn {c.turn_index}, step {c.step}"


def conversations(items: Iterable[Completion]) -> Iterator[list[Completion]]:
    """Consecutive steps of one conversation together (the validated files hold them so, in step order)."""
    group: list[Completion] = []
    for c in items:
        if group and c.prompt_id != group[0].prompt_id:
            yield group
            group = []
        group.append(c)
    if group:
        yield group


def segments(steps: list[Completion]) -> list[Segment]:
    """A conversation's steps as segments, one per user turn, in order."""
    out: list[Segment] = []
    for c in steps:
        if out and out[-1].turn_index == c.turn_index:
            out[-1] = Segment(out[-1].turn_index, (*out[-1].steps, c))
        else:
            out.append(Segment(c.turn_index, (c,)))
    return out


def rejected_turn(last: Completion | None) -> int:
    """The user turn of the step after `last` (a generation reject's step): the same turn when `last` called
    functions (a continuation after its results), else the next one; turn 0 when there is no step before it."""
    if last is None:
        return 0
    turn = last.turn_index
    return turn if last.tool_calls else turn + 1


def unreached_turn_detail(conversation: str, turn: int, ended_turn: int, why: str) -> str:
    """The detail of an `earlier_turn_rejected` row of a user turn never generated: its conversation ended before."""
    return (
        f"conversation {conversation}, turn {turn}: not generated: the conversation ended at turn {ended_turn} ({why})"
    )


def ending_verdict(c: Completion, expected_step: int, previous_turn: int) -> tuple[str, str] | None:
    """(reason, detail) when this step's own record cuts the conversation here, else None.

    Beyond the per-sample checks (datagen.checks.quality): a step the engine ended the conversation with because nothing
    can follow it (`truncated`, or finish reason `length` however `reject_truncated` is set) or because a
    per-turn check failed (`rejected_<reason>`: that reason), and a step out of sequence.
    """
    # A line whose key names no step (a `last` run's) is no step of a conversation generated turn by turn.
    if split_step_key(c.request_key) is None or c.step != expected_step or c.turn_index < previous_turn:
        return MISSING_STEP, (
            f"{where(c)}: expected step {expected_step} (turns in order from {previous_turn}); "
            "an earlier step is missing from the checkpoint"
        )
    if c.outcome == "truncated" or c.finish_reason == "length":
        return "truncated", f"{where(c)}: cut at the token limit after {len(c.output_ids)} tokens; nothing can follow"
    if c.outcome is not None and c.outcome.startswith(_REJECTED_PREFIX):
        return c.outcome[len(_REJECTED_PREFIX) :], f"{where(c)}: generation ended the conversation ({c.outcome})"
    return None
