"""Tokenization stage body: accepted completions in, training parquet (token ids + loss masks) and rejects parquet out.

Token-exact (the default): a row is the rendered prompt's ids followed by the completion's `output_ids`
exactly as the server sampled them. Generated text is never re-tokenized, because a drafter must learn
the target's own token sequence, and BPE of the decoded text is not always the sequence the model
produced. Every row is verified (prompt length against the server's count, decode round trips) and a
row that fails becomes a Reject, never a training row.

Output (all of it is what gets published):
    staging_dir/data/train-00000-of-0000N.parquet     TOKEN_ROW_SCHEMA, `rows_per_file` rows each
    staging_dir/conversations/conversations-00000-of-0000N.jsonl  the same rows as conversations
                                                      (SpecForge's schema: datagen/conversation/export.py)
    staging_dir/rejects/rejects-00000-of-0000M.parquet REJECT_SCHEMA: upstream, validation and tokenize rejects
"""

from __future__ import annotations

import hashlib
import shutil
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from datagen.chat import ChatTokenizer, TemplateError
from datagen.checkpoint import CheckpointError, read_lines
from datagen.checks.quality import NO_CATEGORY, TokenDistribution, completion_body
from datagen.conversation.export import (
    ConversationWriter,
    assistant_turn,
    assistant_view,
    conversation_record,
)
from datagen.conversation.segments import (
    CUT_META_KEY,
    EARLIER_TURN_REJECTED,
    ENDED_BY_REJECT_META_KEY,
    Segment,
    cut_outcome,
    segments,
    where,
)
from datagen.conversation.turn_mode import TurnMode
from datagen.publishing.dataset_card import DatasetSizes
from datagen.records import REJECT_SCHEMA, TOKEN_ROW_SCHEMA, Completion, Message, Reject, TokenRow
from tasks.validation import iter_conversations, iter_jsonl_completions

__all__ = [
    "TOKENIZE_REASONS",
    "ConversationRows",
    "RowRejected",
    "StreamingTokenizer",
    "TokenizationMode",
    "TokenizationSummary",
    "build_conversation_rows",
    "build_rerendered",
    "build_segment_row",
    "build_token_exact",
    "tokenize_accepted",
]

TokenizationMode = Literal["token_exact", "rerender"]

TOKENIZE_REASONS: tuple[str, ...] = (
    "malformed_record",
    "template_error",  # the chat template refused the conversation
    "prompt_token_mismatch",  # our prompt ids differ in length from what the server counted (every turn: any step)
    "bridge_mismatch",  # every turn: a continuing step's prompt is not the ids before it + bridge ids as rendered
    "history_mismatch",  # every turn: a step's history is not the assistant turns generated before it
    "earlier_turn_rejected",  # every turn: a segment after the one that cut its conversation
    "prompt_decode_mismatch",  # the prompt ids do not decode back to the rendered prompt
    "completion_decode_mismatch",  # output ids do not decode to the server's text
    "rerender_unsupported",  # rerender mode: truncated completion or no </think> to split at
    "rerender_prefix_mismatch",  # rerender mode: the conversation does not start with the prompt
)


class RowRejected(ValueError):
    """A completion that cannot become a verified training row."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at character {i} (lengths {len(a)} vs {len(b)}): {a[i : i + 40]!r} vs {b[i : i + 40]!r}"


def _num_turns(messages: list[Message]) -> int:
    return max(1, sum(1 for m in messages if m.role == "user"))


def _token_row(
    first: Completion,
    input_ids: list[int],
    loss_mask: list[int],
    prompt_tokens: int,
    turn_index: int,
    span_finish_reasons: list[str],
) -> TokenRow:
    """The training row answering user turn `turn_index` of `first`'s conversation: one loss span per generated
    assistant message, each ending as its `span_finish_reasons` entry says (the row's finish reason: the last)."""
    return TokenRow(
        prompt_id=first.prompt_id,
        source=first.source,
        input_ids=input_ids,
        loss_mask=loss_mask,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(input_ids) - prompt_tokens,
        finish_reason=span_finish_reasons[-1],
        request_key=first.request_key,
        category=first.category,
        num_turns=turn_index + 1,
        normalized=first.normalized,
        conversation_id=first.prompt_id,
        turn_index=turn_index,
        num_loss_spans=len(span_finish_reasons),
        span_finish_reasons=span_finish_reasons,
        location=first.location,
        source_id=first.source_id,
    )


def _row(c: Completion, input_ids: list[int], loss_mask: list[int], prompt_tokens: int) -> TokenRow:
    # Single-turn mode: the conversation is the prompt plus this one generated turn, so the row answers the last
    # user turn with one loss span (the completion) ending as the server said.
    return _token_row(c, input_ids, loss_mask, prompt_tokens, _num_turns(c.messages) - 1, [c.finish_reason])


def _check_token_exact(
    c: Completion, chat: ChatTokenizer, prompt_text: str, prompt_ids: list[int]
) -> tuple[list[int], int]:
    """Verify one row; return (input_ids, prompt length) or raise RowRejected."""
    if len(prompt_ids) != c.prompt_tokens:
        raise RowRejected(
            "prompt_token_mismatch",
            f"the template renders {len(prompt_ids)} prompt tokens, the server counted {c.prompt_tokens} "
            f"(template {chat.template_hash}): the prompt sent differs from the one rendered here",
        )
    decoded = chat.decode(prompt_ids)
    if decoded != prompt_text:
        raise RowRejected("prompt_decode_mismatch", _first_difference(decoded, prompt_text))
    _check_completion_decode(c, chat)
    return prompt_ids + c.output_ids, len(prompt_ids)


def _check_completion_decode(c: Completion, chat: ChatTokenizer, at: str = "") -> None:
    """The output ids decode to the server's text, or RowRejected (`at`: where, for the detail)."""
    body = completion_body(c)
    text = chat.decode(body)
    # The server may decode with skip_special_tokens; either rendering of the same ids proves they match.
    if text != c.text and chat.decode(body, skip_special_tokens=True) != c.text:
        raise RowRejected("completion_decode_mismatch", at + _first_difference(text, c.text))


def build_token_exact(c: Completion, chat: ChatTokenizer, enable_thinking: bool) -> TokenRow:
    """Prompt ids + the server's output ids, loss on the completion (EOS included); raises RowRejected."""
    try:
        prompt_text = chat.render(c.messages, enable_thinking, c.tools)
    except TemplateError as exc:
        raise RowRejected("template_error", str(exc)) from exc
    ids, n_prompt = _check_token_exact(c, chat, prompt_text, chat.encode(prompt_text))
    return _row(c, ids, [0] * n_prompt + [1] * (len(ids) - n_prompt), n_prompt)


def build_rerendered(c: Completion, chat: ChatTokenizer, enable_thinking: bool) -> TokenRow:
    """Re-render prompt + assistant turn through the template, re-tokenize, and mask the assistant span by offsets.

    The assistant turn is the server's text as `content`; the template splits it at `</think>` into
    reasoning and answer. The whole conversation is encoded once; a token gets loss 1 when its
    character span overlaps the assistant span (end of the generation prompt to the closing `<|im_end|>`).

    Where it agrees with token-exact: thinking on or off, single or multi-turn, whenever the model's ids
    are the canonical BPE of its text and the text has the regular whitespace around `</think>` (then
    the template reproduces the text byte for byte and BPE reproduces the ids).
    Where it differs: (1) the model emitted a non-canonical split (e.g. "\\n" "\\n" as 198 198 where BPE
    gives 271 "\\n\\n"): re-encoding silently replaces the model's real tokens; (2) the template
    normalizes whitespace (strips newlines around the reasoning, re-inserts "\\n\\n" after `</think>`), so
    the text trained on is not the text generated (the Qwen3 family trims content, so an answer opening
    with "\\n" loses it); (3) with a template that does not trim, BPE can merge across the prompt/completion
    boundary (the prompt's "\\n\\n" and an answer's leading "\\n" into one token), so the loss span starts
    inside a prompt token. Token-exact has none of these; rerender exists to compare with the old
    scripts' behaviour and for sources without output ids.
    """
    if c.finish_reason != "stop":
        raise RowRejected("rerender_unsupported", f"finish_reason={c.finish_reason!r}: no complete turn to render")
    try:
        prompt_text = chat.render(c.messages, enable_thinking, c.tools)
        if enable_thinking and "</think>" not in c.text:
            raise RowRejected("rerender_unsupported", "no </think> in the text to split reasoning from answer")
        # The template itself splits "reasoning</think>answer" (as the old scripts had it do), so its own
        # whitespace rules apply, exactly as they would for any consumer re-rendering the conversation.
        turn = Message(role="assistant", content=c.text)
        conversation = chat.render_conversation([*c.messages, turn], enable_thinking, c.tools)
    except TemplateError as exc:
        raise RowRejected("template_error", str(exc)) from exc
    if not conversation.startswith(prompt_text):
        raise RowRejected("rerender_prefix_mismatch", _first_difference(conversation, prompt_text))
    # The template ends the turn with "<|im_end|>\n"; the model's turn ends at <|im_end|>.
    if conversation.endswith("\n"):
        conversation = conversation[:-1]
    ids, offsets = chat.encode_with_offsets(conversation)
    start = len(prompt_text)
    mask = [1 if end > start else 0 for _, end in offsets]
    n_prompt = mask.index(1) if 1 in mask else len(mask)
    return _row(c, ids, mask, n_prompt)


def build_segment_row(
    seg: Segment, chat: ChatTokenizer, enable_thinking: bool, earlier: list[Message]
) -> tuple[TokenRow, list[Message]]:
    """One user turn's row: its first prompt, then each step's output ids and the next step's bridge ids.

    Loss 1 exactly on the output ids. Verified like a token-exact row: the first prompt renders to the tokens
    the server counted and decodes back; each continuing step's server count equals the ids built so far, which
    decode to the template's render of that step's history (so the row is what the template renders); each
    output decodes to the server's text; each step's history holds exactly the assistant turns generated before
    it (`earlier`). Returns the row and the assistant turns including this segment's; raises RowRejected.
    """
    first = seg.steps[0]
    tools = first.tools
    turns = list(earlier)
    ids: list[int] = []
    mask: list[int] = []
    for j, c in enumerate(seg.steps):
        at = where(c)
        history = [assistant_view(m) for m in c.messages if m.role == "assistant"]
        if history != [assistant_view(m) for m in turns]:
            raise RowRejected(
                "history_mismatch",
                f"{at}: the history holds {len(history)} assistant turns that are not the {len(turns)} generated "
                "before this step",
            )
        try:
            text = chat.render(c.messages, enable_thinking, tools)
        except TemplateError as exc:
            raise RowRejected("template_error", f"{at}: {exc}") from exc
        if j == 0:
            if c.bridge_ids is not None:
                raise RowRejected("bridge_mismatch", f"{at}: the first step of a user turn has bridge ids")
            ids = chat.encode(text)
            mask = [0] * len(ids)
        else:
            if c.bridge_ids is None:
                raise RowRejected("bridge_mismatch", f"{at}: a continuing step without bridge ids")
            ids = ids + c.bridge_ids
            mask = mask + [0] * len(c.bridge_ids)
        if len(ids) != c.prompt_tokens:
            raise RowRejected(
                "prompt_token_mismatch",
                f"{at}: {len(ids)} prompt tokens built here, the server counted {c.prompt_tokens} "
                f"(template {chat.template_hash})",
            )
        decoded = chat.decode(ids)
        if decoded != text:
            reason = "prompt_decode_mismatch" if j == 0 else "bridge_mismatch"
            raise RowRejected(
                reason, f"{at}: the ids do not decode to the template's render: " + _first_difference(decoded, text)
            )
        _check_completion_decode(c, chat, f"{at}: ")
        ids = ids + c.output_ids
        mask = mask + [1] * len(c.output_ids)
        turns.append(assistant_turn(c, enable_thinking))
    row = _token_row(first, ids, mask, first.prompt_tokens, seg.turn_index, [c.finish_reason for c in seg.steps])
    return row, turns


@dataclass
class ConversationRows:
    """An every-turn conversation tokenized: its rows, the reject of the segment that cut it and those after."""

    rows: list[TokenRow]
    kept_steps: list[Completion]
    rejects: list[Reject]
    outcome: str | None


def build_conversation_rows(steps: list[Completion], chat: ChatTokenizer, enable_thinking: bool) -> ConversationRows:
    """One row per segment, in order, until the first segment that fails its checks (then reject rows)."""
    result = ConversationRows([], [], [], None)
    turns: list[Message] = []
    segs = segments(steps)
    for i, seg in enumerate(segs):
        try:
            row, turns = build_segment_row(seg, chat, enable_thinking, turns)
        except RowRejected as exc:
            result.rejects.append(_segment_reject(seg, exc.reason, exc.detail))
            for later in segs[i + 1 :]:
                detail = (
                    f"conversation {later.conversation_id}, turn {later.turn_index}: "
                    f"turn {seg.turn_index} was rejected ({exc.reason})"
                )
                result.rejects.append(_segment_reject(later, EARLIER_TURN_REJECTED, detail))
            result.outcome = cut_outcome(exc.reason)
            return result
        result.rows.append(row)
        result.kept_steps.extend(seg.steps)
    last = steps[-1]
    cut = last.meta.get(CUT_META_KEY)
    result.outcome = last.outcome or (cut if isinstance(cut, str) else None)
    return result


def _segment_reject(seg: Segment, reason: str, detail: str) -> Reject:
    first = seg.steps[0]
    return Reject(
        "tokenize",
        reason,
        detail,
        first.source,
        first.row,
        first.prompt_id,
        seg.completion_tokens,
        request_key=first.request_key,
        location=first.location,
        source_id=first.source_id,
    )


class TokenizationSummary(BaseModel):
    """What tokenization wrote: rows, tokens, files (relative to the staging dir) and rejects by stage/reason."""

    mode: TokenizationMode = Field(..., description="token_exact or rerender.")
    rows: int = Field(0, description="Training rows written.")
    input_tokens: int = Field(0, description="Sum of len(input_ids).")
    prompt_tokens: int = Field(0, description="Sum of prompt tokens (loss mask 0).")
    loss_tokens: TokenDistribution = Field(default_factory=TokenDistribution, description="Loss-mask sum per row.")
    rows_by_source: dict[str, int] = Field(default_factory=dict, description="Source -> rows.")
    rows_by_category: dict[str, int] = Field(default_factory=dict, description="Category -> rows.")
    data_files: list[str] = Field(default_factory=list, description="Training parquet files, relative paths.")
    conversation_files: list[str] = Field(
        default_factory=list,
        description="Conversation JSONL files (one line per training row; every turn: per conversation), relative.",
    )
    conversations: int = Field(0, description="Every turn: conversations published (one line each).")
    turns: int = Field(0, description="Every turn: user turns published (one token row each).")
    duplicate_rows: int = Field(0, description="Rows identical (input_ids and loss_mask) to an earlier row: kept.")
    duplicate_groups: int = Field(0, description="Distinct rows that have identical copies.")
    # Every turn: conversations as published, by outcome (the published line's, or the reason of the reject that
    # kept the conversation out of the rows entirely).
    outcomes: dict[str, int] = Field(default_factory=dict, description="Outcome -> conversations, as published.")
    steps: int = Field(0, description="Every turn: generated assistant messages in the published rows.")
    reject_files: list[str] = Field(default_factory=list, description="Rejects parquet files, relative paths.")
    data_bytes: int = Field(0, description="Bytes of the training parquet files.")
    rejects_total: int = Field(0, description="Reject rows written (all stages).")
    rejects_by_stage: dict[str, int] = Field(default_factory=dict, description="Stage -> reject rows.")
    rejects_by_reason: dict[str, int] = Field(default_factory=dict, description="'stage/reason' -> reject rows.")
    tokenize_rejected: int = Field(0, description="Completions rejected here (stage 'tokenize').")
    missing_reject_paths: list[str] = Field(
        default_factory=list, description="Extra reject files that did not exist (a stage with no rejects)."
    )

    @property
    def n_rows(self) -> int:
        return self.rows

    @property
    def n_rejects(self) -> int:
        return self.rejects_total

    def sizes(self) -> DatasetSizes:
        """Sizes for the dataset card."""
        return DatasetSizes(
            num_examples=self.rows,
            num_bytes=self.data_bytes,
            num_input_tokens=self.input_tokens,
            num_loss_tokens=self.loss_tokens.total,
            num_rejects=self.rejects_total,
            num_files=len(self.data_files),
            num_conversations=self.conversations,
            num_turns=self.turns,
            num_duplicate_rows=self.duplicate_rows,
            num_duplicate_groups=self.duplicate_groups,
        )


def _row_hash(row: TokenRow) -> int:
    """8 bytes of a row's content (ids and mask): equal rows, equal hashes."""
    body = array("i", row.input_ids).tobytes() + bytes(row.loss_mask)
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


class _ParquetParts:
    """Writes record batches into numbered part files of at most `rows_per_file` rows each."""

    def __init__(self, tmp_dir: Path, schema: pa.Schema, rows_per_file: int) -> None:
        self._dir = tmp_dir
        self._schema = schema
        self._rows_per_file = rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        self.parts: list[Path] = []

    def _open(self) -> pq.ParquetWriter:
        path = self._dir / f"part-{len(self.parts):05d}.parquet"
        self.parts.append(path)
        self._in_file = 0
        return pq.ParquetWriter(path, self._schema, compression="zstd")

    def write(self, batch: pa.RecordBatch) -> None:
        offset = 0
        while offset < batch.num_rows:
            if self._writer is None or self._in_file >= self._rows_per_file:
                if self._writer is not None:
                    self._writer.close()
                self._writer = self._open()
            take = min(batch.num_rows - offset, self._rows_per_file - self._in_file)
            self._writer.write_batch(batch.slice(offset, take))
            self._in_file += take
            offset += take

    def close(self) -> list[Path]:
        if self._writer is None:  # an empty dataset is still one readable file with the schema
            self._writer = self._open()
        self._writer.close()
        return self.parts


def _finalize(parts: list[Path], out_dir: Path, prefix: str) -> list[Path]:
    n = len(parts)
    final = [out_dir / f"{prefix}-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
    for src, dst in zip(parts, final, strict=True):
        src.replace(dst)
    return final


def _token_batch(rows: list[TokenRow]) -> pa.RecordBatch:
    lengths = np.fromiter((len(r.input_ids) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = np.fromiter(chain.from_iterable(r.input_ids for r in rows), dtype=np.int32, count=total)
    mask = np.fromiter(chain.from_iterable(r.loss_mask for r in rows), dtype=np.int8, count=total)
    arrays = [
        pa.array([r.prompt_id for r in rows], pa.string()),
        pa.array([r.source for r in rows], pa.string()),
        pa.array([r.category for r in rows], pa.string()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        pa.array([r.prompt_tokens for r in rows], pa.int32()),
        pa.array([r.completion_tokens for r in rows], pa.int32()),
        pa.array([r.finish_reason for r in rows], pa.string()),
        pa.array([r.request_key for r in rows], pa.string()),
        pa.array([r.num_turns for r in rows], pa.int16()),
        pa.array([r.normalized for r in rows], pa.string()),
        pa.array([r.conversation_id for r in rows], pa.string()),
        pa.array([r.turn_index for r in rows], pa.int16()),
        pa.array([r.num_loss_spans for r in rows], pa.int16()),
        pa.array([r.span_finish_reasons for r in rows], pa.list_(pa.string())),
        pa.array([r.location for r in rows], pa.string()),
        pa.array([r.source_id for r in rows], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=TOKEN_ROW_SCHEMA)


def _reject_batch(rejects: list[Reject]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([asdict(r) for r in rejects], schema=REJECT_SCHEMA)


def _read_rejects(path: Path) -> Iterator[Reject]:
    for line in read_lines(path):
        row = line.row(path)  # CheckpointError (file:line) when the line is not JSON
        try:
            yield Reject(**row)
        except (ValueError, TypeError) as exc:
            # A reject file we cannot read would lose rejects silently: stop instead.
            raise CheckpointError(f"{path}:{line.lineno}: not a Reject row: {exc}") from exc


def _clean(directory: Path, pattern: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # A previous attempt's files would be published alongside this one's: remove them first.
    for stale in directory.glob(pattern):
        stale.unlink()
    tmp = directory / ".parts"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


class StreamingTokenizer:
    """Tokenizes accepted shards one at a time into the staging dir; `close()` names the files and returns the summary.

    The streaming form of `tokenize_accepted`: shards arrive as they are validated (while others still
    generate), parquet parts stay open across shards, and only the final renames wait for the last shard.
    Existing `data/train-*.parquet` and `rejects/rejects-*.parquet` are removed on construction.

    The unit tokenized is a conversation, as the run's turn mode gathers a file's lines (`iter_conversations`);
    how its rows are built is the mode's (`_ROWS`): a `last` conversation is one row, `batch_size` of them built
    together in `mode`; an every-turn conversation is one token-exact row per user turn.
    """

    def __init__(
        self,
        staging_dir: Path,
        chat: ChatTokenizer,
        enable_thinking: bool,
        rows_per_file: int = 10_000,
        mode: TokenizationMode = "token_exact",
        batch_size: int = 256,
        *,
        turns: TurnMode,
    ) -> None:
        if rows_per_file < 1 or batch_size < 1:
            raise ValueError("rows_per_file and batch_size must be >= 1")
        self.staging_dir = staging_dir
        self.chat = chat
        self.enable_thinking = enable_thinking
        self.mode: TokenizationMode = mode
        self.batch_size = batch_size
        self._rows = _ROWS[turns.name]
        self.turns = turns
        self._data_dir, self._rejects_dir = staging_dir / "data", staging_dir / "rejects"
        _clean(self._data_dir, "train-*.parquet")
        _clean(self._rejects_dir, "rejects-*.parquet")
        self._data = _ParquetParts(self._data_dir / ".parts", TOKEN_ROW_SCHEMA, rows_per_file)
        self._rejects = _ParquetParts(self._rejects_dir / ".parts", REJECT_SCHEMA, 1_000_000)
        self._conversations = ConversationWriter(staging_dir, rows_per_file)
        self.summary = TokenizationSummary(mode=mode)
        self._pending: list[Reject] = []
        # Every row seen, by an 8-byte hash of its ids and mask; those seen twice (datagen.checks.quality's way).
        self._row_hashes: set[int] = set()
        self._copied: set[int] = set()
        # Every turn: conversations this stage cut, from the outcome validation left them with to the cut's.
        self.moved: Counter[tuple[str, str]] = Counter()

    def _reject(self, r: Reject) -> None:
        summary = self.summary
        summary.rejects_total += 1
        summary.rejects_by_stage[r.stage] = summary.rejects_by_stage.get(r.stage, 0) + 1
        key = f"{r.stage}/{r.reason}"
        summary.rejects_by_reason[key] = summary.rejects_by_reason.get(key, 0) + 1
        if r.stage == "tokenize":
            summary.tokenize_rejected += 1
        self._pending.append(r)
        if len(self._pending) >= 10_000:
            self._rejects.write(_reject_batch(self._pending))
            self._pending.clear()

    def add_rejects(self, path: Path) -> None:
        """Merge an earlier stage's reject JSONL (load, generate, validate) into the rejects dataset."""
        path = Path(path)
        if not path.exists():
            self.summary.missing_reject_paths.append(str(path))
            return
        for r in _read_rejects(path):
            self._reject(r)

    def add_accepted(self, path: Path) -> None:
        """Tokenize one accepted-completions JSONL file (validation wrote each conversation's lines together)."""
        path = Path(path)
        batch = self._rows.batch(self)
        pending: list[list[Completion]] = []  # conversations read and not yet built
        read = 0  # items read since the last build (a malformed line counts as one)
        for item in iter_conversations(iter_jsonl_completions(path), self.turns):
            if isinstance(item, tuple):
                lineno, err = item
                self._reject(Reject("tokenize", "malformed_record", f"{path.name}:{lineno}: {err}", path.name))
            else:
                pending.append(item)
            read += 1
            if read >= batch:
                self._rows.build(self, pending)
                pending, read = [], 0
        if pending:
            self._rows.build(self, pending)

    def _one_row_each(self, conversations: list[list[Completion]]) -> None:
        """Build `last` conversations, one row each (their one line), together in the tokenization mode."""
        completions = [c for (c,) in conversations]
        rows: list[TokenRow] = []
        built = _build_batch(completions, self.chat, self.enable_thinking, self.mode)
        for c, result in zip(completions, built, strict=True):
            if isinstance(result, RowRejected):
                self._reject(
                    Reject(
                        "tokenize",
                        result.reason,
                        result.detail,
                        c.source,
                        c.row,
                        c.prompt_id,
                        len(c.output_ids),
                        location=c.location,
                        source_id=c.source_id,
                    )
                )
            else:
                rows.append(result)
                self._conversations.write(conversation_record([c], self.enable_thinking))
        self._write_rows(rows)

    def _write_rows(self, rows: list[TokenRow]) -> None:
        summary = self.summary
        if rows:
            self._data.write(_token_batch(rows))
        for row in rows:
            digest = _row_hash(row)
            if digest in self._row_hashes:
                summary.duplicate_rows += 1
                self._copied.add(digest)
                summary.duplicate_groups = len(self._copied)
            else:
                self._row_hashes.add(digest)
            summary.rows += 1
            summary.input_tokens += len(row.input_ids)
            summary.prompt_tokens += row.prompt_tokens
            summary.loss_tokens.add(sum(row.loss_mask))
            summary.rows_by_source[row.source] = summary.rows_by_source.get(row.source, 0) + 1
            cat = row.category or NO_CATEGORY
            summary.rows_by_category[cat] = summary.rows_by_category.get(cat, 0) + 1

    def _segment_rows(self, conversations: list[list[Completion]]) -> None:
        """Tokenize every-turn conversations, each as it is read: its segment rows and one published line.

        Always token-exact (`rerender` applies to `last` rows only): a continuing step's prompt is what the server
        was sent, ids the model generated included, which a re-tokenized rendering need not reproduce.
        """
        for steps in conversations:
            built = build_conversation_rows(steps, self.chat, self.enable_thinking)
            if built.rejects and built.outcome is not None:
                last = steps[-1]
                before = last.outcome or last.meta.get(CUT_META_KEY) or last.meta.get(ENDED_BY_REJECT_META_KEY)
                if isinstance(before, str):
                    self.moved[(before, built.outcome)] += 1
            for r in built.rejects:
                self._reject(r)
            if built.rows:
                self._write_rows(built.rows)
                self._conversations.write(conversation_record(built.kept_steps, self.enable_thinking, built.outcome))
                self.summary.conversations += 1
                self.summary.turns += len(built.rows)
                self.summary.steps += len(built.kept_steps)

    def close(self) -> TokenizationSummary:
        """Close the parquet parts, give them their final `-of-N` names and return what was written."""
        summary = self.summary
        if self._pending:
            self._rejects.write(_reject_batch(self._pending))
            self._pending.clear()
        data_files = _finalize(self._data.close(), self._data_dir, "train")
        reject_files = _finalize(self._rejects.close(), self._rejects_dir, "rejects")
        conversation_files = self._conversations.close()
        (self._data_dir / ".parts").rmdir()
        (self._rejects_dir / ".parts").rmdir()
        summary.data_files = [str(p.relative_to(self.staging_dir)) for p in data_files]
        summary.reject_files = [str(p.relative_to(self.staging_dir)) for p in reject_files]
        summary.conversation_files = [str(p.relative_to(self.staging_dir)) for p in conversation_files]
        summary.data_bytes = sum(p.stat().st_size for p in data_files)
        return summary


@dataclass(frozen=True)
class _RowPolicy:
    """How a turn mode's conversations become rows: how many are built together, and the build."""

    batch: Callable[[StreamingTokenizer], int]
    build: Callable[[StreamingTokenizer, list[list[Completion]]], None]


# By turn mode (StreamingTokenizer's docstring). Every turn builds each conversation as it is read, so its rows and
# rejects keep the file's order.
_ROWS: dict[str, _RowPolicy] = {
    "last": _RowPolicy(lambda t: t.batch_size, StreamingTokenizer._one_row_each),
    "every": _RowPolicy(lambda t: 1, StreamingTokenizer._segment_rows),
}


def tokenize_accepted(
    accepted_paths: Sequence[Path],
    staging_dir: Path,
    chat: ChatTokenizer,
    enable_thinking: bool,
    rows_per_file: int = 10_000,
    mode: TokenizationMode = "token_exact",
    extra_reject_paths: Sequence[Path] = (),
    batch_size: int = 256,
    *,
    turns: TurnMode,
) -> TokenizationSummary:
    """Write training parquet shards and one rejects dataset into `staging_dir`; return what was written.

    `extra_reject_paths` are reject JSONL files of earlier stages (load, generate, validate) merged into
    the rejects dataset. Existing `data/train-*.parquet` and `rejects/rejects-*.parquet` are replaced.
    """
    tokenizer = StreamingTokenizer(staging_dir, chat, enable_thinking, rows_per_file, mode, batch_size, turns=turns)
    for path in extra_reject_paths:
        tokenizer.add_rejects(Path(path))
    for path in accepted_paths:
        tokenizer.add_accepted(Path(path))
    return tokenizer.close()


def _build_batch(
    completions: list[Completion], chat: ChatTokenizer, enable_thinking: bool, mode: TokenizationMode
) -> list[TokenRow | RowRejected]:
    out: list[TokenRow | RowRejected] = []
    if mode == "rerender":
        for c in completions:
            try:
                out.append(build_rerendered(c, chat, enable_thinking))
            except RowRejected as exc:
                out.append(exc)
        return out
    texts: list[str | None] = []
    template_errors: dict[int, RowRejected] = {}
    for i, c in enumerate(completions):
        try:
            texts.append(chat.render(c.messages, enable_thinking, c.tools))
        except TemplateError as exc:
            texts.append(None)
            template_errors[i] = RowRejected("template_error", str(exc))
    # One parallel encode for the whole batch (the Rust tokenizer spreads it over cores).
    encoded = iter(chat.encode_batch([t for t in texts if t is not None]))
    for i, (c, text) in enumerate(zip(completions, texts, strict=True)):
        if text is None:
            out.append(template_errors[i])
            continue
        prompt_ids = next(encoded)
        try:
            ids, n_prompt = _check_token_exact(c, chat, text, prompt_ids)
        except RowRejected as exc:
            out.append(exc)
            continue
        out.append(_row(c, ids, [0] * n_prompt + [1] * (len(ids) - n_prompt), n_prompt))
    return out
