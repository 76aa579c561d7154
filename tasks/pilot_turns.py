"""The pilot's measurements in every-turn mode: its sample is conversations, measured per step, turn and conversation.

    measure_completions(layout, plan)        `last` mode: one completion per sampled prompt (as before)
    measure_conversations(layout, plan, ...) every-turn mode: the steps of each sampled conversation
    step_model(measure)                      mean step length per category and kind of step (first user turn,
                                             later user turns, tool rounds: `tasks.ordering.StepModel`)
    chain_walls(...)                         the every-turn run's wall time: the full set as chains of steps
    turn_report(conversations)               the pilot report's per-turn rows and its table of outcomes

Both measures return a `PilotMeasure`, what `tasks.pilot.project` projects from: per source, the output tokens of
each sample (a conversation's steps summed), the tokens of the training rows it makes, and the samples for the
length model (which the main run's long-first order uses to rank conversations by their total output). In
every-turn mode it also holds each sampled conversation's steps: the wall time is simulated on them as chains
(`tasks.chains.simulate_chains`: step k+1 starts once step k has ended, a freed slot takes the ready step with the
most expected work left, as the shard driver ranks them).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datagen.checkpoint import read_rows
from datagen.conversation.regeneration import is_query, split_step_key
from datagen.conversation.turn_mode import TurnMode
from datagen.conversation.turn_stats import Step, TurnSummary, conversations, distribution
from datagen.layout import RunLayout
from datagen.records import Message, Prompt
from tasks.chains import Chain, DecodeModel, simulate_chains
from tasks.generation import read_prompts
from tasks.ordering import (
    STEP_KINDS,
    LengthModel,
    LengthSample,
    StepKind,
    StepModel,
    prompt_chars,
    step_kind,
    step_lengths,
)
from tasks.planning import ShardPlan

__all__ = [
    "PilotMeasure",
    "SampledChain",
    "chain_walls",
    "conversation_key",
    "keys_by_conversation",
    "measure",
    "measure_completions",
    "measure_conversations",
    "repeat_counts",
    "step_model",
    "turn_report",
    "user_turns",
]


@dataclass(frozen=True, slots=True)
class SampledChain:
    """One sampled conversation that produced output: its prompt and its steps' output tokens, in order."""

    prompt: Prompt
    steps: tuple[int, ...]


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
    chains: list[SampledChain] | None = None  # every sampled conversation with output
    step_lengths: list[tuple[str | None, StepKind, int]] | None = None  # (category, kind, tokens) of every step


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


def measure(
    layout: RunLayout, plan: ShardPlan, turns: TurnMode, validation_reject_paths: Collection[str] = ()
) -> PilotMeasure:
    """The pilot's measurements in the run's turn mode: a sample is a prompt, or (every turn) a conversation."""
    completions = _rows(layout.shard_completions(i) for i in plan.shard_ids)
    rejects = _rows(layout.shard_rejects(i) for i in plan.shard_ids)
    if turns.continues:
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
    m = PilotMeasure(rows=rows_by_source, segments=segments, steps=steps, chains=[], step_lengths=[])
    assert m.chains is not None and m.step_lengths is not None
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
            ordered: list[Step] = sorted(conv.steps, key=lambda s: s.step)
            m.chains.append(SampledChain(prompt, tuple(s.completion_tokens for s in ordered)))
            m.step_lengths += [
                (prompt.category, step_kind(s.turn_index, s.first_of_turn), s.completion_tokens) for s in ordered
            ]
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
    by_kind: dict[str, list[int]] = defaultdict(list)
    for _, kind, tokens in m.step_lengths:
        by_kind[kind].append(tokens)
    m.conversations = {
        **summary.model_dump(),
        "user_turns_in_source": distribution(source_turns),
        "rows_per_conversation": round(sum(rows_by_source.values()) / n, 3) if n else 0.0,
        "output_tokens_per_step_by_kind": {k: distribution(by_kind[k]) for k in STEP_KINDS if by_kind[k]},
    }
    return m


def repeat_counts(n: int, target: int) -> list[int]:
    """How often each of `n` samples is repeated to stand for `target` (largest remainder: the total is exact)."""
    if n <= 0 or target <= 0:
        return [0] * max(n, 0)
    w = target / n
    counts = [int(w)] * n
    for i in sorted(range(n), key=lambda i: -((w * (i + 1)) % 1))[: target - sum(counts)]:
        counts[i] += 1
    return counts


def step_model(measured: PilotMeasure) -> StepModel | None:
    """The step lengths the pilot measured, by category and kind (None in `last` mode, or when no step ran)."""
    return StepModel.fit(measured.step_lengths) if measured.step_lengths else None


def chain_walls(
    measured: PilotMeasure,
    population_by_source: Mapping[str, int],
    sample_by_source: Mapping[str, int],
    length_model: LengthModel,
    steps_model: StepModel | None,
    servers: int,
    slots: int,
    model: DecodeModel,
    seed: int,
) -> dict[str, float]:
    """Simulated seconds of an every-turn run: the full set (and the part the pilot did not sample) as chains.

    Each source's sampled conversations stand for its population (each repeated by its weight; a conversation
    refused on its first step takes no decode time). A freed slot takes the ready step with the most expected work
    left, as the shard driver ranks (`tasks.generation.pilot_step_tokens`: each step's expected length from
    `tasks.ordering.step_lengths`, the same call); plan order breaks ties: long-first by the length model's
    prediction (`wall_s`, what `order: long_first` plans), or a seeded shuffle (`wall_s_source`).
    """
    expected = step_lengths(length_model, steps_model)
    by_source: dict[str, list[SampledChain]] = defaultdict(list)
    for c in measured.chains or []:
        by_source[c.prompt.source].append(c)
    full: list[tuple[float, Chain]] = []
    rest: list[tuple[float, Chain]] = []
    for source, n_pop in population_by_source.items():
        sampled = by_source.get(source, [])
        if not sampled:
            continue
        completing = len(sampled) / (len(sampled) + measured.gen_rejects[source])
        built = []
        for c in sampled:
            chain = Chain(c.steps, user_turns(c.prompt), expected(c.prompt))
            built.append((length_model.predict(c.prompt), chain))
        not_sampled = max(0, n_pop - sample_by_source.get(source, len(sampled)))
        for items, target in ((full, n_pop), (rest, not_sampled)):
            for item, k in zip(built, repeat_counts(len(built), round(target * completing)), strict=True):
                items += [item] * k

    def ordered(items: list[tuple[float, Chain]], long_first: bool) -> list[Chain]:
        shuffled = list(items)
        random.Random(seed).shuffle(shuffled)  # file order mixes the strata; ties of long-first keep it
        if long_first:
            shuffled.sort(key=lambda x: -x[0])
        return [c for _, c in shuffled]

    def wall(items: list[tuple[float, Chain]], long_first: bool) -> float:
        return simulate_chains(ordered(items, long_first), servers, slots, model, "expected_work_left").wall_s

    return {
        "wall_s": wall(full, True),
        "wall_s_source": wall(full, False),
        "wall_s_reusing_pilot": wall(rest, True),
    }


_KIND_LABELS = {"first_turn": "first user turn", "later_turn": "later user turns", "tool_round": "tool rounds"}


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
        *(
            f"| output tokens per step, {_KIND_LABELS[kind]}: mean / p90 (steps) | "
            f"{d['mean']:,} / {d['p90']:,} ({d['n']:,}) |"
            for kind, d in conversations.get("output_tokens_per_step_by_kind", {}).items()
        ),
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
