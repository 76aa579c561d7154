"""The pilot's measurements in every-turn mode: its sample is conversations, measured per step, turn and conversation.

    measure_completions(layout, plan)        `last` mode: one completion per sampled prompt (as before)
    measure_conversations(layout, plan, ...) every-turn mode: the steps of each sampled conversation
    turn_report(conversations)               the pilot report's per-turn rows and its table of outcomes

Both return a `PilotMeasure`, what `tasks.pilot.project` projects from: per source, the output tokens of each
sample (a conversation's steps summed: a conversation holds one slot from its first step to its last, because its
next step is requested as soon as one is done), the tokens of the training rows it makes, and the samples for the
length model (which the main run's long-first order uses to rank conversations by their total output).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datagen.checkpoint import read_rows
from datagen.layout import RunLayout
from datagen.records import Message, Prompt
from datagen.regeneration import is_query, split_step_key
from datagen.turn_stats import TurnSummary, conversations, distribution, is_step_row
from tasks.generation import read_prompts
from tasks.ordering import LengthSample, prompt_chars
from tasks.planning import ShardPlan

__all__ = [
    "PilotMeasure",
    "conversation_key",
    "keys_by_conversation",
    "measure",
    "measure_completions",
    "measure_conversations",
    "turn_report",
    "user_turns",
]


@dataclass(slots=True)
class PilotMeasure:
    """What the pilot's checkpoints hold, per source, in the shape the projection reads."""

    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per sample that produced output
    row_tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per training row it makes
    gen_rejects: Counter[str] = field(default_factory=Counter)  # samples rejected before any output
    samples: list[LengthSample] = field(default_factory=list)
    request_tokens: list[int] = field(default_factory=list)  # output tokens of each request (completion or step)
    # Every-turn mode only: rows its conversations make and the user-turn segments they reached, per source,
    # and the per-turn measurements (None in `last` mode, where a sample is one request and one row).
    rows: Counter[str] | None = None
    segments: Counter[str] | None = None
    steps: Counter[str] | None = None
    conversations: dict[str, Any] | None = None


def conversation_key(request_key: str) -> str:
    """The conversation's request key of a step's (`<key>:step-N` -> `<key>`); a `last` mode key is its own."""
    split = split_step_key(request_key)
    return split[0] if split is not None else request_key


def keys_by_conversation(request_keys: Iterable[str]) -> dict[str, list[str]]:
    """Conversation key -> the request keys of its lines, in the order given (a `last` mode key: itself alone)."""
    out: dict[str, list[str]] = defaultdict(list)
    for key in request_keys:
        out[conversation_key(key)].append(key)
    return dict(out)


def _rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    return [row for path in paths for row in read_rows(path)]


def measure(layout: RunLayout, plan: ShardPlan, validation_reject_paths: Collection[str] = ()) -> PilotMeasure:
    """The pilot's measurements in whichever mode its checkpoint lines were written."""
    completions = _rows(layout.shard_completions(i) for i in plan.shard_ids)
    rejects = _rows(layout.shard_rejects(i) for i in plan.shard_ids)
    if any(is_step_row(c) for c in completions):
        return measure_conversations(layout, plan, completions, rejects, validation_reject_paths)
    return measure_completions(completions, rejects)


def measure_completions(completions: list[dict[str, Any]], rejects: list[dict[str, Any]]) -> PilotMeasure:
    """`last` mode: each completion is one sample and one row; a generation reject is a sample without output."""
    m = PilotMeasure()
    for c in completions:
        m.tokens[c["source"]].append(int(c["completion_tokens"]))
        m.row_tokens[c["source"]].append(int(c["prompt_tokens"]) + int(c["completion_tokens"]))
        m.request_tokens.append(int(c["completion_tokens"]))
        chars = sum(len(Message.from_dict(msg).text) for msg in c["messages"])
        m.samples.append(
            LengthSample(
                source=c["source"],
                category=c["category"],
                prompt_chars=chars,
                output_tokens=int(c["completion_tokens"]),
            )
        )
    for r in rejects:
        m.gen_rejects[r["source"]] += 1
    return m


def user_turns(prompt: Prompt) -> int:
    """User turns of a conversation: its user messages that are queries, not `<tool_response>` text (the template's
    rule for the last query)."""
    return sum(is_query(msg) for msg in prompt.messages)


def _rejected_keys(paths: Collection[str]) -> set[str]:
    """Request keys the validation stage rejected (its `<shard>.rejects.jsonl` files)."""
    return {str(r["request_key"]) for p in paths for r in read_rows(Path(p)) if r.get("request_key")}


def measure_conversations(
    layout: RunLayout,
    plan: ShardPlan,
    completions: list[dict[str, Any]],
    rejects: list[dict[str, Any]],
    validation_reject_paths: Collection[str] = (),
) -> PilotMeasure:
    """Every-turn mode: each sampled conversation is one sample, its steps' output tokens summed.

    Its rows follow the row rule (one per user-turn segment with a kept step; a segment whose step validation
    rejected, or whose last step ended truncated or rejected_<reason>, ends the conversation's rows there).
    """
    convs = conversations(completions, rejects)
    rejected = _rejected_keys(validation_reject_paths)
    rows_by_source: Counter[str] = Counter()
    segments: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    m = PilotMeasure(rows=rows_by_source, segments=segments, steps=steps)
    source_turns: list[int] = []
    sampled = []
    for shard_id in plan.shard_ids:
        for prompt in read_prompts(layout.shard_prompts(shard_id)):
            conv = convs.get(prompt.prompt_id)
            if conv is None:  # no line: the pilot did not settle it (a failed shard), so it says nothing
                continue
            sampled.append(conv)
            source_turns.append(user_turns(prompt))
            src = prompt.source
            segments[src] += max(1, conv.turns)
            steps[src] += len(conv.steps)  # a conversation refused on its first step reached one turn
            if not conv.steps:
                m.gen_rejects[src] += 1
                continue
            m.tokens[src].append(conv.output_tokens)
            m.request_tokens += [s.completion_tokens for s in conv.steps]
            rows = conv.row_tokens(rejected)
            rows_by_source[src] += len(rows)
            m.row_tokens[src] += rows
            m.samples.append(
                LengthSample(
                    source=src,
                    category=prompt.category,
                    prompt_chars=prompt_chars(prompt),
                    output_tokens=conv.output_tokens,
                )
            )
    summary = TurnSummary.of(sampled)
    n = len(sampled)
    m.conversations = {
        **summary.model_dump(),
        "user_turns_in_source": distribution(source_turns),
        "rows_per_conversation": round(sum(rows_by_source.values()) / n, 3) if n else 0.0,
    }
    return m


def turn_report(conversations: dict[str, Any] | None, projection: dict[str, Any]) -> list[str]:
    """The pilot report's every-turn section (none in `last` mode)."""
    if not conversations:
        return []
    step, turn, conv = (
        conversations["output_tokens_per_step"],
        conversations["steps_per_user_turn"],
        conversations["user_turns_per_conversation"],
    )
    src, total = conversations["user_turns_in_source"], conversations["output_tokens_per_conversation"]
    lines = [
        "",
        "## Per turn (every-turn mode: the sample is conversations)",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| conversations sampled / finished | {conversations['conversations']:,} / {conversations['finished']:,} |",
        f"| steps generated (one generation each) | {conversations['steps']:,} |",
        f"| output tokens per step: mean / p50 / p90 / p99 | "
        f"{step['mean']:,} / {step['p50']:,} / {step['p90']:,} / {step['p99']:,} |",
        f"| steps per user turn: mean / p90 / max | {turn['mean']:,} / {turn['p90']:,} / {turn['max']:,} |",
        f"| user turns per conversation, reached: mean / p90 / max | "
        f"{conv['mean']:,} / {conv['p90']:,} / {conv['max']:,} |",
        f"| user turns per conversation, in the source: mean / p90 / max | "
        f"{src['mean']:,} / {src['p90']:,} / {src['max']:,} |",
        f"| output tokens per conversation: mean / p50 / p90 / p99 | "
        f"{total['mean']:,} / {total['p50']:,} / {total['p90']:,} / {total['p99']:,} |",
        f"| training rows (user-turn segments) per conversation | {conversations['rows_per_conversation']:,} |",
        f"| steps projected for the full set | {projection.get('steps', 0):,} |",
        "",
        "| conversation ended | conversations | share of finished |",
        "|---|---:|---:|",
    ]
    finished = conversations["finished"] or 1
    for outcome, n in conversations["outcomes"].items():
        lines.append(f"| {outcome} | {n:,} | {n / finished:.1%} |")
    return lines
