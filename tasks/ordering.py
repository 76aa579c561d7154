"""Long outputs first: predict each prompt's output length and plan shards longest-expected first.

Also the every-turn driver's expected step lengths (`StepModel`, `step_lengths`): what it ranks conversations by.

The dispatcher sends requests in plan position order (`GenerateJob.order` = (shard, row); retries and requeued
requests first), whichever shard worker submitted them and when, so the order of the shard files is the dispatch
order. Putting the long generations first leaves only short ones for the end of the run, where the last slots
would otherwise run one long request each while the rest of the GPU idles.

The predictor (`LengthModel`) is fitted on a pilot's completions: a mean per (source, category), shrunk toward
its source's mean and the global mean when it rests on few samples, times a power of the prompt's length in
characters (a cheap feature that needs no tokenizer).
"""

from __future__ import annotations

import heapq
import math
import shutil
from array import array
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.conversation.regeneration import Script
from datagen.conversation.turn_mode import expected_steps
from datagen.identity import PromptIdentity, known_before
from datagen.records import Prompt, Reject
from datagen.runspec import RunSpec
from datagen.sources.preparation import Unsendable
from datagen.sources.prompts import iter_prompts
from tasks.selection import Items, PromptFilter, SelectionReport, choose, filtered

__all__ = [
    "STEP_KINDS",
    "GroupStat",
    "LengthModel",
    "LengthSample",
    "StepKind",
    "StepLengths",
    "StepModel",
    "long_first",
    "long_first_filter",
    "prompt_chars",
    "recorded_kinds",
    "run_filter",
    "step_kind",
    "step_lengths",
]

# Pseudo-samples pulling a small group's mean toward its parent's: 5 samples weigh as much as the prior.
SHRINKAGE = 5.0
MIN_SAMPLES_FOR_SLOPE = 20
SPILL_RUN = 50_000  # prompts held in memory per sorted run; more spill to disk and are merged


def prompt_chars(p: Prompt) -> int:
    """The prompt's length in characters over all its messages."""
    return sum(len(m.text) for m in p.messages)


class GroupStat(BaseModel):
    """Samples and mean output tokens of one group."""

    model_config = ConfigDict(frozen=True)

    n: int
    mean: float


class LengthSample(BaseModel):
    """One pilot observation: the prompt's features and the output tokens it took."""

    source: str
    category: str | None
    prompt_chars: int
    output_tokens: int


class LengthModel(BaseModel):
    """Predicted output tokens of a prompt from its source, category and length."""

    global_mean: float = Field(..., description="Mean output tokens over all samples.")
    by_source: dict[str, GroupStat] = Field(default_factory=dict)
    by_category: dict[str, dict[str, GroupStat]] = Field(
        default_factory=dict, description="source -> category -> stats."
    )
    slope: float = Field(0.0, description="Exponent of (prompt chars / typical prompt chars); 0 when not fitted.")
    log_chars_mean: float = Field(0.0, description="Mean log(1 + prompt chars) of the samples.")

    @classmethod
    def fit(cls, samples: Iterable[LengthSample]) -> LengthModel:
        """Fit group means (with shrinkage) and the prompt-length exponent on pilot samples."""
        rows = list(samples)
        if not rows:
            raise ValueError("a length model needs at least one sample")
        global_mean = sum(r.output_tokens for r in rows) / len(rows)
        src: dict[str, list[int]] = defaultdict(list)
        grp: dict[tuple[str, str], list[int]] = defaultdict(list)
        for r in rows:
            src[r.source].append(r.output_tokens)
            if r.category is not None:
                grp[(r.source, r.category)].append(r.output_tokens)
        by_source = {s: GroupStat(n=len(v), mean=sum(v) / len(v)) for s, v in sorted(src.items())}
        by_category: dict[str, dict[str, GroupStat]] = defaultdict(dict)
        for (s, c), v in sorted(grp.items()):
            by_category[s][c] = GroupStat(n=len(v), mean=sum(v) / len(v))
        model = cls(global_mean=global_mean, by_source=by_source, by_category=dict(by_category))
        # Prompt length: least squares of the log residual on centred log chars, over samples with output.
        xs = [math.log1p(r.prompt_chars) for r in rows if r.output_tokens > 0]
        if len(xs) < MIN_SAMPLES_FOR_SLOPE:
            return model
        x_mean = sum(xs) / len(xs)
        resid = [
            math.log(r.output_tokens) - math.log(max(model._group_mean(r.source, r.category), 1.0))
            for r in rows
            if r.output_tokens > 0
        ]
        sxx = sum((x - x_mean) ** 2 for x in xs)
        sxy = sum((x - x_mean) * y for x, y in zip(xs, resid, strict=True))
        # Clamped: a small pilot must not turn a weak correlation into an extreme prediction.
        slope = max(-1.0, min(1.0, sxy / sxx)) if sxx > 1e-9 * len(xs) else 0.0
        return model.model_copy(update={"slope": slope, "log_chars_mean": x_mean})

    def _group_mean(self, source: str, category: str | None) -> float:
        stat = self.by_source.get(source)
        source_mean = (
            (stat.n * stat.mean + SHRINKAGE * self.global_mean) / (stat.n + SHRINKAGE) if stat else self.global_mean
        )
        cat = self.by_category.get(source, {}).get(category) if category is not None else None
        return (cat.n * cat.mean + SHRINKAGE * source_mean) / (cat.n + SHRINKAGE) if cat else source_mean

    def predict(self, p: Prompt) -> float:
        """Expected output tokens of a prompt."""
        return self.predict_features(p.source, p.category, prompt_chars(p))

    def predict_features(self, source: str, category: str | None, chars: int) -> float:
        """Expected output tokens from the features alone (source, category, prompt length in characters)."""
        base = self._group_mean(source, category)
        if self.slope == 0.0:
            return base
        return base * math.exp(self.slope * (math.log1p(chars) - self.log_chars_mean))


# What a step answers: the first user turn, a later user turn, or a tool round (a continuation after the results of
# the calls its turn's previous step made). Their lengths differ (an opening answer, a follow-up, a short call).
StepKind = Literal["first_turn", "later_turn", "tool_round"]
STEP_KINDS: tuple[StepKind, ...] = ("first_turn", "later_turn", "tool_round")


def step_kind(turn_index: int, first_of_turn: bool) -> StepKind:
    """The kind of a step from its user turn and whether it opens that turn."""
    if not first_of_turn:
        return "tool_round"
    return "first_turn" if turn_index == 0 else "later_turn"


def recorded_kinds(prompt: Prompt) -> tuple[StepKind, ...]:
    """The kinds of the steps a conversation's regeneration is expected to take (`expected_steps`, in order)."""
    try:
        script = Script.of(prompt)
    except Unsendable:
        return ("first_turn",)  # its first step is rejected when it opens
    return tuple(step_kind(t, j == 0) for t, turn in enumerate(script.turns) for j in range(max(1, len(turn.steps))))


class StepModel(BaseModel):
    """Mean output tokens of a step by its kind, and by category and kind (the pilot's every-turn measurement).

    A small group's mean is pulled toward its parent's (category and kind -> kind -> all steps) by `SHRINKAGE`
    pseudo-samples, as `LengthModel` does for sources and categories.
    """

    global_mean: float = Field(..., description="Mean output tokens over all steps.")
    by_kind: dict[str, GroupStat] = Field(default_factory=dict, description="first_turn | later_turn | tool_round.")
    by_category: dict[str, dict[str, GroupStat]] = Field(
        default_factory=dict, description="category -> kind -> stats (conversations without one: no entry)."
    )

    @classmethod
    def fit(cls, steps: Iterable[tuple[str | None, StepKind, int]]) -> StepModel:
        """Fit on (category, kind, output tokens) of every generated step."""
        rows = list(steps)
        if not rows:
            raise ValueError("a step model needs at least one step")
        kind: dict[str, list[int]] = defaultdict(list)
        grp: dict[tuple[str, str], list[int]] = defaultdict(list)
        for category, step, n in rows:
            kind[step].append(n)
            if category is not None:
                grp[(category, step)].append(n)
        by_category: dict[str, dict[str, GroupStat]] = defaultdict(dict)
        for (c, k), v in sorted(grp.items()):
            by_category[c][k] = GroupStat(n=len(v), mean=sum(v) / len(v))
        return cls(
            global_mean=sum(n for _, _, n in rows) / len(rows),
            by_kind={k: GroupStat(n=len(v), mean=sum(v) / len(v)) for k, v in sorted(kind.items())},
            by_category=dict(by_category),
        )

    def mean(self, category: str | None, kind: StepKind) -> float:
        """Expected output tokens of a step of this kind in this category."""
        stat = self.by_kind.get(kind)
        kind_mean = (
            (stat.n * stat.mean + SHRINKAGE * self.global_mean) / (stat.n + SHRINKAGE) if stat else self.global_mean
        )
        cat = self.by_category.get(category, {}).get(kind) if category is not None else None
        return (cat.n * cat.mean + SHRINKAGE * kind_mean) / (cat.n + SHRINKAGE) if cat else kind_mean

    def expected(self, prompt: Prompt) -> tuple[float, ...]:
        """Each expected step's length, in order (its recorded turns and tool rounds)."""
        return tuple(self.mean(prompt.category, k) for k in recorded_kinds(prompt))


# A conversation's expected output tokens of each step it is expected to take, in order.
StepLengths = Callable[[Prompt], tuple[float, ...]]


def step_lengths(length_model: LengthModel, step_model: StepModel | None) -> StepLengths:
    """Each expected step's length, as the every-turn driver ranks conversations by work left (and the pilot's
    projection simulates it, `tasks.pilot_turns.chain_walls`): the step model's means by category and kind when
    the pilot measured steps; else (a pilot of `last` mode, or one written before it measured steps) the length
    model's prediction of the whole output shared evenly over the expected steps."""
    if step_model is not None:
        return step_model.expected

    def shared(prompt: Prompt) -> tuple[float, ...]:
        n = expected_steps(prompt)
        return (length_model.predict(prompt) / n,) * n

    return shared


def long_first(items: Iterable[Prompt | Reject], model: LengthModel, spill_dir: Path, run: int = SPILL_RUN) -> Items:
    """Prompts by predicted output length, longest first (ties keep input order); load rejects pass through first.

    An external merge sort: runs of `run` prompts are sorted and spilled to `spill_dir` (removed at the end), so
    memory stays bounded at any prompt count.
    """
    runs: list[Path] = []
    buffer: list[tuple[float, int, Prompt]] = []
    try:
        for seq, item in enumerate(items):
            if isinstance(item, Reject):
                yield item
                continue
            buffer.append((-model.predict(item), seq, item))
            if len(buffer) >= run:
                runs.append(_spill(buffer, spill_dir, len(runs)))
                buffer = []
        buffer.sort(key=lambda e: (e[0], e[1]))
        if not runs:
            for _, _, prompt in buffer:
                yield prompt
            return
        if buffer:
            runs.append(_spill(buffer, spill_dir, len(runs)))
        for _, _, ids, line in heapq.merge(*(_read_run(path) for path in runs)):
            prompt = Prompt.from_json(line)
            if ids:
                prompt.input_ids = array("i")
                prompt.input_ids.frombytes(bytes.fromhex(ids))
            yield prompt
    finally:
        if runs:
            shutil.rmtree(spill_dir, ignore_errors=True)


def long_first_filter(model: LengthModel, spill_dir: Path, then: PromptFilter | None = None) -> PromptFilter:
    """A planning hook: apply `then` (e.g. a selection), then order longest-expected first."""

    def select(items: Items) -> Items:
        return long_first(then(items) if then else items, model, spill_dir)

    return select


def _spill(buffer: list[tuple[float, int, Prompt]], spill_dir: Path, index: int) -> Path:
    buffer.sort(key=lambda e: (e[0], e[1]))
    spill_dir.mkdir(parents=True, exist_ok=True)
    path = spill_dir / f"run-{index:05d}.tsv"
    with open(path, "w", encoding="utf-8") as f:
        for key, seq, prompt in buffer:
            # repr() of a float round-trips exactly; JSON never holds a raw tab or newline. The rendered ids
            # (not part of a prompt's JSON) travel too, so planning need not render the prompt again.
            ids = prompt.input_ids.tobytes().hex() if prompt.input_ids is not None else ""
            f.write(f"{key!r}\t{seq}\t{ids}\t{prompt.to_json()}\n")
    return path


def _read_run(path: Path) -> Iterator[tuple[float, int, str, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, seq, ids, body = line.rstrip("\n").split("\t", 3)
            yield float(key), int(seq), ids, body


def run_filter(
    spec: RunSpec,
    skip: Collection[str],
    spill_dir: Path,
    model: LengthModel | None = None,
    base_dir: Path | None = None,
) -> tuple[PromptFilter | None, SelectionReport | None]:
    """The planning hook of a main run: skip published ids, apply the targets, order longest-expected first.

    Targets need one extra pass over the sources (to draw their seeded sample); the report is None without one.
    """
    keep: PromptFilter | None = None
    report: SelectionReport | None = None
    if spec.source_targets or spec.category_targets:
        selection, report = choose(
            iter_prompts(spec.sources, base_dir, PromptIdentity.for_spec(spec)),
            skip,
            spec.source_target_counts,
            spec.category_target_counts,
            spec.selection_seed,
        )
        keep = filtered(selection.keeps)
    elif skip:
        keep = filtered(lambda p: not known_before(p, skip))
    if spec.order == "long_first":
        if model is None:
            raise ValueError("order 'long_first' needs the pilot's length model")
        return long_first_filter(model, spill_dir, then=keep), report
    return keep, report
