"""Conversations and their steps, counted from the shards' checkpoint lines: what the pilot, progress and reports show.

In every-turn mode (docs/conversations.md) each generation is one `Completion` line ("step") carrying `step`,
`turn_index`, `bridge_ids` (None on a user turn's first step) and, on the conversation's last step, `outcome`;
a step rejected before or during generation is a generation `Reject` line whose `reason` ends the conversation.
Everything here reads only those fields of the lines, so it also reads `last` mode lines (one step per
conversation, no outcome): the checkpoint files are the one source, for a live run and a finished one alike.

    Conversation / conversations(...)   one conversation's steps, grouped from completion and reject rows
    TurnSummary.of(...)                 per-step, per-turn and per-conversation distributions and outcomes
    StepTail                            live counts over growing checkpoint files (reads only appended lines)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from datagen.checkpoint import CheckpointTail

__all__ = [
    "COMPLETE",
    "Conversation",
    "Step",
    "StepTail",
    "TurnCounts",
    "TurnSummary",
    "conversations",
    "distribution",
    "ends_segment",
    "is_step_row",
]

COMPLETE = "complete"  # the outcome of a conversation whose every user turn was answered
_PERCENTILES = (50, 90, 99)


def is_step_row(row: Mapping[str, Any]) -> bool:
    """Whether a checkpoint row is a step of an every-turn conversation (`last` mode rows carry no `step`)."""
    return row.get("step") is not None


def ends_segment(outcome: str | None) -> bool:
    """Whether a last step's outcome drops its user-turn segment from the rows (truncated, or a failed check)."""
    return outcome is not None and (outcome == "truncated" or outcome.startswith("rejected_"))


@dataclass(frozen=True, slots=True)
class Step:
    """The fields of one step line that counting needs."""

    step: int
    turn_index: int
    request_key: str
    completion_tokens: int
    prompt_tokens: int
    outcome: str | None = None
    first_of_turn: bool = True  # `bridge_ids` is None: the step opens its user turn

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Step:
        """From a completion row; a `last` mode row is step 0 of turn 0."""
        return cls(
            step=int(row.get("step") or 0),
            turn_index=int(row.get("turn_index") or 0),
            request_key=str(row.get("request_key", "")),
            completion_tokens=int(row.get("completion_tokens", 0)),
            prompt_tokens=int(row.get("prompt_tokens", 0)),
            outcome=row.get("outcome"),
            first_of_turn=row.get("bridge_ids") is None,
        )


@dataclass(slots=True)
class Conversation:
    """One conversation as its checkpoint lines tell it: its steps in order and, when it ended, why."""

    prompt_id: str
    source: str
    category: str | None = None
    steps: list[Step] = field(default_factory=list)
    rejected: str | None = None  # a generation Reject ended it: its reason

    @property
    def outcome(self) -> str | None:
        """Why it ended: the last step's outcome, or the reason of the reject that ended it; None while it goes on."""
        if self.rejected is not None:
            return self.rejected
        return self.steps[-1].outcome if self.steps else None

    @property
    def output_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)

    @property
    def turns(self) -> int:
        """User turns it reached (with at least one generated step)."""
        return len({s.turn_index for s in self.steps})

    def steps_per_turn(self) -> list[int]:
        """Generated steps of each user turn it reached, in turn order."""
        counts = Counter(s.turn_index for s in self.steps)
        return [counts[t] for t in sorted(counts)]

    def row_tokens(self, rejected_keys: Collection[str] = ()) -> list[int]:
        """Tokens of each training row its steps make: one per kept user-turn segment (the contract's row rule).

        A segment's row is its first prompt, then every step's output and the next step's bridge: the last step's
        prompt_tokens + completion_tokens. A segment with a step in `rejected_keys` (validation rejected it) or
        whose last step ended truncated / rejected_<reason> is no row, and the conversation ends there.
        """
        rows: list[int] = []
        by_turn: dict[int, list[Step]] = {}
        for s in self.steps:
            by_turn.setdefault(s.turn_index, []).append(s)
        for turn in sorted(by_turn):
            segment = by_turn[turn]
            if any(s.request_key in rejected_keys for s in segment) or ends_segment(segment[-1].outcome):
                break
            rows.append(segment[-1].prompt_tokens + segment[-1].completion_tokens)
        return rows


def conversations(
    completion_rows: Iterable[Mapping[str, Any]], reject_rows: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Conversation]:
    """Prompt id -> its conversation, from a run's (or pilot's) completion and generation-reject rows.

    A reject whose request a completion settles too (a retried request) does not end the conversation.
    """
    out: dict[str, Conversation] = {}
    settled: set[str] = set()
    for row in completion_rows:
        conv = out.setdefault(
            str(row["prompt_id"]), Conversation(str(row["prompt_id"]), str(row["source"]), row.get("category"))
        )
        step = Step.of(row)
        conv.steps.append(step)
        settled.add(step.request_key)
    for row in reject_rows:
        if row.get("request_key") in settled or row.get("prompt_id") is None:
            continue
        conv = out.setdefault(str(row["prompt_id"]), Conversation(str(row["prompt_id"]), str(row["source"])))
        conv.rejected = str(row["reason"])
    for conv in out.values():
        conv.steps.sort(key=lambda s: s.step)
    return out


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0
    return sorted_values[max(1, math.ceil(q / 100 * len(sorted_values))) - 1]


def distribution(values: Iterable[float], mean_digits: int = 2) -> dict[str, float]:
    """n, mean (rounded to `mean_digits`), p50/p90/p99 (nearest rank) and max."""
    v = sorted(values)
    out: dict[str, float] = {"n": len(v), "mean": round(sum(v) / len(v), mean_digits) if v else 0.0}
    out.update({f"p{q}": _percentile(v, q) for q in _PERCENTILES})
    out["max"] = v[-1] if v else 0
    return out


class TurnSummary(BaseModel):
    """A set of conversations measured per step, per user turn and per conversation."""

    conversations: int = Field(description="Conversations with at least one line (a step or a reject).")
    finished: int = Field(description="Conversations that ended (their last step has an outcome, or a reject).")
    steps: int = Field(description="Generated steps (one generation each).")
    user_turns: int = Field(description="User turns reached (with at least one generated step).")
    # Distributions (datagen.conversation.turn_stats.distribution): counts and percentiles stay integers, means are
    # floats.
    output_tokens_per_step: dict[str, int | float]
    steps_per_user_turn: dict[str, int | float]
    user_turns_per_conversation: dict[str, int | float]
    output_tokens_per_conversation: dict[str, int | float]
    outcomes: dict[str, int] = Field(description="Outcome -> conversations that ended with it.")
    ended_early: dict[str, float] = Field(
        description="Outcome other than complete -> its share of the finished conversations."
    )

    @classmethod
    def of(cls, convs: Iterable[Conversation]) -> TurnSummary:
        """Measure these conversations."""
        items = list(convs)
        outcomes = Counter(c.outcome for c in items if c.outcome is not None)
        finished = sum(outcomes.values())
        return cls(
            conversations=len(items),
            finished=finished,
            steps=sum(len(c.steps) for c in items),
            user_turns=sum(c.turns for c in items),
            output_tokens_per_step=distribution(s.completion_tokens for c in items for s in c.steps),
            steps_per_user_turn=distribution(n for c in items for n in c.steps_per_turn()),
            user_turns_per_conversation=distribution(c.turns for c in items),
            output_tokens_per_conversation=distribution(c.output_tokens for c in items),
            outcomes=dict(outcomes.most_common()),
            ended_early={k: round(n / finished, 4) for k, n in outcomes.most_common() if k != COMPLETE and finished},
        )


@dataclass(frozen=True, slots=True)
class TurnCounts:
    """Live counts of a run's conversations and steps, over its checkpoint files."""

    planned: int  # conversations the run planned (its prompts)
    finished: int = 0
    steps: int = 0
    user_turns: int = 0  # steps that opened a user turn
    output_tokens: int = 0
    outcomes: Mapping[str, int] = field(default_factory=dict)

    @property
    def ended_early(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k != COMPLETE)

    def summary(self) -> dict[str, Any]:
        """Plain JSON for the flow's return value."""
        return {
            "conversations_planned": self.planned,
            "conversations_finished": self.finished,
            "steps": self.steps,
            "user_turns": self.user_turns,
            "conversations_by_outcome": dict(self.outcomes),
        }


class StepTail:
    """Counts steps and finished conversations in checkpoint files that grow while generation runs.

    Each `poll` reads only what was appended since the last one, up to the last newline (bytes after it are a
    write in progress or a torn tail: the checkpoint policy in datagen.checkpoint), so a look at a large run
    costs what it generated since the previous look. Counts are over the whole files: lines written by an earlier
    attempt, or imported from a pilot, are counted as settled like the rest.
    """

    def __init__(self, completion_paths: Sequence[Path], reject_paths: Sequence[Path], planned: int) -> None:
        self._tails = [(CheckpointTail(Path(p)), True) for p in completion_paths]
        self._tails += [(CheckpointTail(Path(p)), False) for p in reject_paths]
        self._planned = planned
        self._finished = self._steps = self._turns = self._tokens = 0
        self._outcomes: Counter[str] = Counter()

    def poll(self) -> TurnCounts:
        """Read what was appended and return the counts so far; CheckpointError (file:line) on a corrupt line."""
        for tail, is_completion in self._tails:
            for line in tail.read():
                row = line.row(tail.path)
                if is_completion:
                    self._steps += 1
                    self._tokens += int(row.get("completion_tokens", 0))
                    self._turns += row.get("bridge_ids") is None
                    outcome = row.get("outcome")
                else:
                    outcome = row.get("reason")
                if outcome is not None:
                    self._finished += 1
                    self._outcomes[str(outcome)] += 1
        return TurnCounts(
            planned=self._planned,
            finished=self._finished,
            steps=self._steps,
            user_turns=self._turns,
            output_tokens=self._tokens,
            outcomes=dict(self._outcomes.most_common()),
        )
