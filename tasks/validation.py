"""Validation stage body: generation checkpoints in, accepted completions + reject rows out, one pair per shard.

Streams each shard line by line (design scale ~1M samples): only counters and one 8-byte hash per
accepted sample stay in memory. Shards are read in the order given, so "first copy kept" for
duplicates is deterministic. Each output file is written under a temporary name and renamed when
complete, so a crash never leaves a half shard that looks finished.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from datagen.checkpoint import CheckpointLine, read_lines, read_rows
from datagen.checks.quality import (
    DuplicateIndex,
    SummaryBuilder,
    ValidationSummary,
    Verdict,
    check_completion,
)
from datagen.conversation.regeneration import Script
from datagen.conversation.segments import (
    CUT_META_KEY,
    EARLIER_TURN_REJECTED,
    ENDED_BY_REJECT_META_KEY,
    MISSING_STEP,
    cut_outcome,
    ending_verdict,
    rejected_turn,
    segments,
    unreached_turn_detail,
    where,
)
from datagen.conversation.turn_mode import TurnMode
from datagen.records import Completion, Prompt, Reject
from datagen.runspec import ValidationSpec
from datagen.sources.preparation import Unsendable

__all__ = [
    "REPORT_NAME",
    "SUMMARY_NAME",
    "MalformedRecord",
    "ShardValidator",
    "count_reject_reasons",
    "iter_conversations",
    "iter_in_plan_order",
    "iter_jsonl_completions",
    "shard_stem",
    "validate_shards",
]

SUMMARY_NAME = "validation-summary.json"
REPORT_NAME = "validation-report.md"  # published beside the data (flows/expand_dataset.py)

# Fields a checkpoint line must carry with these types; anything else is a malformed record, not a crash.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "prompt_id": str,
    "source": str,
    "row": int,
    "messages": list,
    "request_key": str,
    "prompt_tokens": int,
    "output_ids": list,
    "text": str,
    "finish_reason": str,
    "completion_tokens": int,
}


class MalformedRecord(ValueError):
    """A checkpoint line that is not a Completion; carries what could be read of it."""

    def __init__(self, message: str, raw: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.raw = raw or {}


def _parse(line: str) -> Completion:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedRecord(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise MalformedRecord(f"not a JSON object: {type(raw).__name__}")
    for key, typ in _REQUIRED.items():
        if not isinstance(raw.get(key), typ):
            raise MalformedRecord(f"field {key!r} missing or not {typ}", raw)
    if not all(isinstance(i, int) for i in raw["output_ids"]):
        raise MalformedRecord("output_ids holds non-integers", raw)
    try:
        return Completion(**raw)
    except (TypeError, ValueError) as exc:  # unknown keys; messages that are not Messages
        raise MalformedRecord(str(exc), raw) from exc


def _judge(line: CheckpointLine) -> tuple[int, Completion | MalformedRecord]:
    try:
        return line.lineno, _parse(line.text)
    except MalformedRecord as exc:
        return line.lineno, exc


def iter_jsonl_completions(path: Path) -> Iterator[tuple[int, Completion | MalformedRecord]]:
    """(line number, Completion or the MalformedRecord error) for each committed line (datagen.checkpoint)."""
    for line in read_lines(path):
        yield _judge(line)


# The plan position generation records in `meta`; a key of the record, never text inside a JSON string
# (where its quotes would be escaped).
_PLAN_INDEX_RE = re.compile(r'[{,] ?"plan_index": ?(\d+)')
# The conversation (the record's first key) and the request key (the field after `messages`), read the same way;
# the turn mode reads a line's step from its request key.
_PROMPT_ID_RE = re.compile(r'^\{"prompt_id": ?"((?:[^"\\]|\\.)*)"')
_REQUEST_KEY_RE = re.compile(r'\], ?"request_key": ?"((?:[^"\\]|\\.)*)", ?"prompt_tokens": ?\d')
_NO_POSITION = 1 << 62


def iter_in_plan_order(path: Path, turns: TurnMode) -> Iterator[tuple[int, Completion | MalformedRecord]]:
    """Like iter_jsonl_completions, but in the shard's plan order (meta.plan_index), not the order they finished.

    Two passes over the file: offsets and plan positions first (a few bytes per line), then the lines in
    order; lines without a plan position keep their file order after the others. The steps of a conversation
    (those `turns` gives a step: every-turn lines) come together, in step order, at the conversation's first plan
    position.
    """
    index: list[tuple[int, str, int, int, int, int]] = []  # (position, conversation, step, line, offset, length)
    first: dict[str, int] = {}  # conversation -> its lowest plan position (lines with a step only)
    for line in read_lines(path):
        found = _PLAN_INDEX_RE.findall(line.text)
        position = int(found[-1]) if found else _NO_POSITION
        request_key = _REQUEST_KEY_RE.search(line.text)
        step = None if request_key is None else turns.plan_step(request_key.group(1))
        conversation = _PROMPT_ID_RE.match(line.text) if step is not None else None
        key, order = (conversation.group(1), step) if conversation and step is not None else ("", -1)
        if key:
            first[key] = min(first.get(key, position), position)
        index.append((position, key, order, line.lineno, line.offset, line.length))
    index.sort(key=lambda e: (first.get(e[1], e[0]), *e[1:]))
    with path.open("rb") as f:
        for *_, lineno, start, size in index:
            f.seek(start)
            yield _judge(CheckpointLine(lineno, start, size, f.read(size)[:-1].decode("utf-8")))


def iter_conversations(
    items: Iterable[tuple[int, Completion | MalformedRecord]], turns: TurnMode
) -> Iterator[list[Completion] | tuple[int, MalformedRecord]]:
    """A shard's lines as the conversations `turns` gathers them (consecutive lines of one conversation, e.g. every
    turn's steps of a prompt; else one line each), each malformed line on its own as (line number, error)."""
    group: list[Completion] = []
    of = turns.conversation_of
    for lineno, item in items:
        key = None if isinstance(item, MalformedRecord) else of(item)
        if group and (key is None or key != of(group[0])):
            yield group
            group = []
        if isinstance(item, MalformedRecord):
            yield lineno, item
        elif key is None:
            yield [item]
        else:
            group.append(item)
    if group:
        yield group


def count_reject_reasons(paths: list[Path]) -> dict[str, int]:
    """'stage/reason' -> rows over reject JSONL files (a missing file holds none)."""
    counts: dict[str, int] = {}
    for path in paths:
        for line in read_lines(path):
            r = Reject(**line.row(path))  # CheckpointError (file:line) when the line is not JSON
            key = f"{r.stage}/{r.reason}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def shard_stem(path: Path) -> str:
    """`shard-00003` for `shard-00003.completions.jsonl` (output names follow their input's)."""
    name = path.name
    for suffix in (".completions.jsonl", ".accepted.jsonl", ".jsonl"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


@contextmanager
def _atomic_text(path: Path) -> Iterator[IO[str]]:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _reject(c: Completion, v: Verdict) -> Reject:
    assert v.reason is not None
    return Reject(
        stage="validate",
        reason=v.reason,
        detail=v.detail,
        source=c.source,
        row=c.row,
        prompt_id=c.prompt_id,
        completion_tokens=len(c.output_ids),
        location=c.location,
        source_id=c.source_id,
    )


def _turn_reject(like: Completion | Reject | Prompt, turn: int, detail: str) -> Reject:
    """The `earlier_turn_rejected` row of a user turn of `like`'s conversation that makes no row."""
    return Reject(
        stage="validate",
        reason=EARLIER_TURN_REJECTED,
        detail=detail,
        source=like.source,
        row=like.row,
        prompt_id=like.prompt_id,
        completion_tokens=0,
        location=like.location,
        source_id=like.source_id,
    )


@dataclass
class _ShardConversations:
    """What an every-turn shard holds besides its step lines: each conversation's user turns (its script) and the
    generation reject that ended it, if one did (datagen.conversation.ledger: at most one)."""

    turns: dict[str, int] = field(default_factory=dict)
    rows: dict[str, Prompt] = field(default_factory=dict)  # where each came from (messages dropped)
    rejected: dict[str, Reject] = field(default_factory=dict)
    judged: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, prompts_path: Path | None, rejects_path: Path | None) -> _ShardConversations:
        out = cls()
        if prompts_path is not None and prompts_path.is_file():
            for line in read_lines(prompts_path):
                prompt = Prompt.from_json(line.text)
                try:
                    out.turns[prompt.prompt_id] = len(Script.of(prompt).turns)
                except Unsendable:
                    out.turns[prompt.prompt_id] = 1  # no query: its first step was refused, the one turn
                out.rows[prompt.prompt_id] = replace(prompt, messages=[], tools=None)
        if rejects_path is not None:
            for row in read_rows(rejects_path):
                r = Reject(**row)
                if r.prompt_id is not None:
                    out.rejected[r.prompt_id] = r
        return out


def _malformed(path: Path, lineno: int, err: MalformedRecord) -> Reject:
    raw = err.raw
    row = raw.get("row")
    prompt_id = raw.get("prompt_id")
    return Reject(
        stage="validate",
        reason="malformed_record",
        detail=f"{path.name}:{lineno}: {err}",
        source=str(raw.get("source") or path.name),
        row=row if isinstance(row, int) else None,
        prompt_id=prompt_id if isinstance(prompt_id, str) else None,
        location=raw["location"] if isinstance(raw.get("location"), str) else None,
    )


class ShardValidator:
    """Validates shards one at a time, in the order given, carrying the duplicate index and the summary between them.

    The streaming form of `validate_shards`: the flow feeds each shard once it and every shard before it in
    plan order is generated, so "first copy kept" stays the same as a single pass over all shards.

    The unit judged is a conversation, as the run's turn mode gathers a shard's lines (`iter_conversations`); how
    one is judged is the mode's (`_JUDGES`): a `last` conversation is its one line, accepted or rejected; an
    every-turn conversation is judged step by step and cut at its first failing step.
    """

    def __init__(
        self,
        out_dir: Path,
        spec: ValidationSpec,
        enable_thinking: bool,
        words: np.ndarray | None = None,
        *,
        turns: TurnMode,
    ) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.words = words  # word tokens of the vocabulary (datagen.checks.repetition.word_tokens): structure vs loops
        self.spec = spec
        self.enable_thinking = enable_thinking
        self.turns = turns
        self._judge = _JUDGES[turns.name]
        self._builder = SummaryBuilder()
        self._duplicates = DuplicateIndex(steps=turns.continues)
        self._stems: set[str] = set()
        self._shard = _ShardConversations()

    @property
    def summary(self) -> ValidationSummary:
        """The summary of the shards added so far."""
        return self._builder.summary

    def add(self, path: Path, prompts_path: Path | None = None, rejects_path: Path | None = None) -> tuple[Path, Path]:
        """Validate one shard's completions; return its (accepted, rejects) JSONL paths.

        `prompts_path` and `rejects_path` (the shard's prompts and generation rejects): where a conversation can
        take several steps (every turn), each user turn that no step reached (its conversation ended before it) is
        an `earlier_turn_rejected` row, and a conversation that a generation reject ended counts under its reason.
        """
        path = Path(path)
        stem = shard_stem(path)
        if stem in self._stems:
            raise ValueError(f"two input shards map to the same output name: {stem} ({path})")
        self._stems.add(stem)
        builder = self._builder
        accepted_path = self.out_dir / f"{stem}.accepted.jsonl"
        self._shard = (
            _ShardConversations.read(prompts_path, rejects_path) if self.turns.continues else _ShardConversations()
        )
        out_rejects = self.out_dir / f"{stem}.rejects.jsonl"
        with _atomic_text(accepted_path) as acc, _atomic_text(out_rejects) as rej:
            # Plan order, whatever finished first: the copy kept of a duplicate is the one planned first.
            for item in iter_conversations(iter_in_plan_order(path, self.turns), self.turns):
                if isinstance(item, tuple):
                    r = _malformed(path, *item)
                    builder.reject(r)
                    rej.write(r.to_json() + "\n")
                else:
                    self._judge(self, item, acc, rej)
            # Conversations a generation reject ended before any step: their other user turns.
            for prompt_id, r in self._shard.rejected.items():
                if prompt_id not in self._shard.judged:
                    self._ended(prompt_id, r, 0, r.reason, rej)
        builder.summary.accepted_paths.append(str(accepted_path))
        builder.summary.reject_paths.append(str(out_rejects))
        return accepted_path, out_rejects

    def _ended(self, prompt_id: str, like: Completion | Reject, ended_turn: int, why: str, rej: IO[str]) -> None:
        """Count how the conversation ended; write a row for each of its user turns after `ended_turn`."""
        outcomes = self._builder.summary.conversation_outcomes
        outcomes[why] = outcomes.get(why, 0) + 1
        origin = self._shard.rows.get(prompt_id, like)
        for turn in range(ended_turn + 1, self._shard.turns.get(prompt_id, 0)):
            r = _turn_reject(origin, turn, unreached_turn_detail(prompt_id, turn, ended_turn, why))
            self._builder.reject(r)
            rej.write(r.to_json() + "\n")

    def _one_line(self, steps: list[Completion], acc: IO[str], rej: IO[str]) -> None:
        """Judge a `last` conversation: its one line, by the per-sample checks, then as a duplicate."""
        (c,) = steps
        spec = self.spec
        verdict = check_completion(c, spec, self.enable_thinking, self.words)
        if verdict.accepted:
            dup = self._duplicates.check_and_add(c, spec.reject_duplicate_completions)
            if not dup.accepted:
                verdict = dup
        if verdict.accepted:
            self._builder.accept(c, verdict)
            acc.write(c.to_json() + "\n")
        else:
            r = _reject(c, verdict)
            self._builder.reject(r)
            rej.write(r.to_json() + "\n")

    def _steps(self, steps: list[Completion], acc: IO[str], rej: IO[str]) -> None:
        """Judge an every-turn conversation step by step; cut it at its first failing step.

        The segments (user turns) before the failing one are kept, step by step; the failing segment is one
        reject row with the reason and the turn, each later segment one `earlier_turn_rejected` row. A step
        written twice (the same request key) is a `duplicate_request` row and does not cut the conversation.
        """
        kept: list[tuple[Completion, Verdict]] = []
        cut: tuple[Completion, str, str] | None = None
        turn = 0
        for c in steps:
            ended = ending_verdict(c, len(kept), turn)
            if ended is not None and ended[0] == MISSING_STEP and kept and c.step == kept[-1][0].step:
                verdict = Verdict("duplicate_request", f"{where(c)}: request key {c.request_key} was already accepted")
                r = _reject(c, verdict)
                self._builder.reject(r)
                rej.write(r.to_json() + "\n")
                continue
            verdict = check_completion(c, self.spec, self.enable_thinking, self.words)
            if verdict.accepted and ended is None:
                duplicate = self._duplicates.check_and_add(c, self.spec.reject_duplicate_completions)
                if not duplicate.accepted:
                    verdict = duplicate  # else the check's verdict stays: it carries the answer's tokens
            if ended is None and verdict.accepted:
                kept.append((c, verdict))
                turn = c.turn_index
                continue
            # The per-sample check names a failing step first (its detail is the more precise); then the record.
            if verdict.reason is not None:
                reason, detail = verdict.reason, f"{where(c)}: {verdict.detail}"
            else:
                assert ended is not None
                reason, detail = ended
            cut = (c, reason, detail)
            break
        prompt_id = steps[0].prompt_id
        self._shard.judged.add(prompt_id)
        ended_by = self._shard.rejected.get(prompt_id)
        if cut is None:
            last = steps[-1]
            for i, (c, verdict) in enumerate(kept):
                self._builder.accept(c, verdict)
                if i + 1 == len(kept) and last.outcome is None and ended_by is not None:
                    c = replace(c, meta={**c.meta, ENDED_BY_REJECT_META_KEY: ended_by.reason})
                acc.write(c.to_json() + "\n")
            if last.outcome is not None:
                self._ended(prompt_id, last, last.turn_index, last.outcome, rej)
            elif ended_by is not None:  # its next step was refused: that step's turn is the reject's row
                self._ended(prompt_id, last, rejected_turn(last), ended_by.reason, rej)
            return
        failing, reason, detail = cut
        failing_turn = failing.turn_index
        survivors = [(c, verdict) for c, verdict in kept if c.turn_index < failing_turn]
        for i, (c, verdict) in enumerate(survivors):
            self._builder.accept(c, verdict)
            if i + 1 == len(survivors):  # the published conversation ends here, and says why
                c = replace(c, meta={**c.meta, CUT_META_KEY: cut_outcome(reason)})
            acc.write(c.to_json() + "\n")
        dropped = [c for c in steps if c.turn_index >= failing_turn]
        for seg in segments(dropped):
            first = seg.steps[0]
            if seg.turn_index == failing_turn:
                r = _reject(first, Verdict(reason, detail))
                r.request_key = failing.request_key
            else:
                r = _reject(
                    first,
                    Verdict(
                        EARLIER_TURN_REJECTED,
                        f"conversation {first.prompt_id}, turn {seg.turn_index}: turn {failing_turn} was rejected "
                        f"({reason})",
                    ),
                )
            r.completion_tokens = seg.completion_tokens
            self._builder.reject(r)
            rej.write(r.to_json() + "\n")
        # The turns after the last one with steps: never generated (a generation reject's own turn has its row).
        last_turn = max(failing_turn, *(seg.turn_index for seg in segments(dropped)))
        if ended_by is not None and rejected_turn(steps[-1]) > last_turn:
            last_turn = rejected_turn(steps[-1])
        outcomes = self._builder.summary.conversation_outcomes
        why = cut_outcome(reason)
        outcomes[why] = outcomes.get(why, 0) + 1
        for turn in range(last_turn + 1, self._shard.turns.get(prompt_id, 0)):
            detail = f"conversation {prompt_id}, turn {turn}: turn {failing_turn} was rejected ({reason})"
            r = _turn_reject(self._shard.rows.get(prompt_id, failing), turn, detail)
            self._builder.reject(r)
            rej.write(r.to_json() + "\n")

    def close(self) -> ValidationSummary:
        """The summary of every shard added; also written to `validation-summary.json` in `out_dir`."""
        summary = self._builder.summary
        (self.out_dir / SUMMARY_NAME).write_text(summary.model_dump_json(indent=1), encoding="utf-8")
        return summary


# How a conversation is judged, by turn mode (ShardValidator's docstring).
_JUDGES: dict[str, Callable[[ShardValidator, list[Completion], IO[str], IO[str]], None]] = {
    "last": ShardValidator._one_line,
    "every": ShardValidator._steps,
}


def validate_shards(
    completion_paths: list[Path],
    out_dir: Path,
    spec: ValidationSpec,
    enable_thinking: bool,
    words: np.ndarray | None = None,
    *,
    turns: TurnMode,
) -> ValidationSummary:
    """Check every completion; write `<shard>.accepted.jsonl` and `<shard>.rejects.jsonl` per shard into `out_dir`.

    Also writes `validation-summary.json` (the returned summary) into `out_dir`. Every input line ends
    up in exactly one of the two outputs.
    """
    stems = [shard_stem(Path(p)) for p in completion_paths]
    if len(set(stems)) != len(stems):
        raise ValueError(f"two input shards map to the same output name: {stems}")
    validator = ShardValidator(out_dir, spec, enable_thinking, words, turns=turns)
    for path in completion_paths:
        validator.add(Path(path))
    return validator.close()
