"""Streaming finish: validate and tokenize each shard as soon as it is generated, while later shards still generate.

Shards are finished in plan order: a shard is taken once it and every shard before it is generated, so the
duplicate check's "first copy kept", the reject order and the training file order are those of one pass over
all shards, whatever order generation finished them in (the dispatcher serves plan order, so the finished
prefix follows generation closely). After the last shard only its own validation and tokenization, the final
file renames, the gates and the publish remain: that tail no longer grows with the number of prompts.

    stream = StreamingFinish(plan.shard_ids, layout, chat, spec)
    for result in shards_as_they_finish:
        for ready in stream.ready(result):
            finish_shard(stream, ready)          # the flow wraps this as a task, one run per shard
    summary = close_validation(stream)           # ValidationSummary of every shard
    tokenized = close_tokenization(stream)       # TokenizationSummary; parquet files get their final names
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from datagen.chat import ChatTokenizer
from datagen.checks.quality import ValidationSummary
from datagen.checks.repetition import word_tokens
from datagen.conversation.turn_mode import turn_mode
from datagen.layout import RunLayout
from datagen.runspec import RunSpec
from tasks.generation import ShardResult
from tasks.tokenization import StreamingTokenizer, TokenizationSummary
from tasks.validation import ShardValidator

__all__ = ["ShardFinished", "StreamingFinish", "close_tokenization", "close_validation", "finish_shard"]


class ShardFinished(BaseModel):
    """What finishing one shard did: counts so far, for logs and progress."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shard_id: int
    shards_finished: int
    accepted_so_far: int
    rejected_so_far: int
    rows_so_far: int


class StreamingFinish:
    """Validation and tokenization state carried from shard to shard, fed in plan order."""

    def __init__(self, shard_ids: Sequence[int], layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> None:
        self._order = list(shard_ids)
        if len(set(self._order)) != len(self._order):
            raise ValueError(f"shard ids repeat: {self._order}")
        self._position = {shard_id: i for i, shard_id in enumerate(self._order)}
        self._layout = layout
        self._next = 0
        self._waiting: dict[int, ShardResult] = {}
        self._handed_out = 0
        self.finished: list[ShardResult] = []
        self.validator = ShardValidator(
            layout.validated_dir,
            spec.validation,
            spec.sampling.enable_thinking,
            word_tokens(chat),
            turns=turn_mode(spec),
        )
        self.tokenizer = StreamingTokenizer(
            layout.staging_dir, chat, spec.sampling.enable_thinking, turns=turn_mode(spec)
        )
        self.tokenizer.add_rejects(layout.load_rejects)
        self._validation: ValidationSummary | None = None
        self._tokenized: TokenizationSummary | None = None

    def ready(self, result: ShardResult) -> list[ShardResult]:
        """Record a generated shard; return the shards that can be finished now, in plan order."""
        if result.shard_id not in self._position:
            raise ValueError(f"shard {result.shard_id} is not in this plan")
        if self._position[result.shard_id] < self._next or result.shard_id in self._waiting:
            raise ValueError(f"shard {result.shard_id} was reported twice")
        self._waiting[result.shard_id] = result
        out: list[ShardResult] = []
        while self._next < len(self._order) and self._order[self._next] in self._waiting:
            out.append(self._waiting.pop(self._order[self._next]))
            self._next += 1
        return out

    @property
    def all_generated(self) -> bool:
        """Every planned shard has been reported to `ready`."""
        return self._next == len(self._order)

    def finish(self, result: ShardResult) -> ShardFinished:
        """Validate and tokenize one shard; shards must come in the order `ready` handed them out."""
        expected = self._order[len(self.finished)] if len(self.finished) < len(self._order) else None
        if result.shard_id != expected:
            raise ValueError(f"shard {result.shard_id} finished out of plan order (expected {expected})")
        accepted, validation_rejects = self.validator.add(
            Path(result.completions_path), self._layout.shard_prompts(result.shard_id), Path(result.rejects_path)
        )
        self.tokenizer.add_rejects(Path(result.rejects_path))
        self.tokenizer.add_rejects(validation_rejects)
        self.tokenizer.add_accepted(accepted)
        self.finished.append(result)
        summary = self.validator.summary
        return ShardFinished(
            shard_id=result.shard_id,
            shards_finished=len(self.finished),
            accepted_so_far=summary.accepted,
            rejected_so_far=summary.rejected,
            rows_so_far=self.tokenizer.summary.rows,
        )

    def close_validation(self) -> ValidationSummary:
        """The validation summary of all shards (written to `validation-summary.json`)."""
        if len(self.finished) != len(self._order):
            missing = [s for s in self._order if s not in {r.shard_id for r in self.finished}]
            raise RuntimeError(f"{len(missing)} shards were never finished (first: {missing[:5]})")
        if self._validation is None:
            self._validation = self.validator.close()
        return self._validation

    def close_tokenization(self) -> TokenizationSummary:
        """Name the training and rejects parquet files and return what tokenization wrote."""
        self.close_validation()
        if self._tokenized is None:
            self._tokenized = self.tokenizer.close()
            # Every turn: each conversation's outcome as published (validation's, then tokenization's cuts).
            outcomes = Counter(self.close_validation().conversation_outcomes)
            for (before, after), n in self.tokenizer.moved.items():
                outcomes[before] -= n
                outcomes[after] += n
            self._tokenized.outcomes = {k: n for k, n in outcomes.most_common() if n > 0}
        return self._tokenized


def finish_shard(stream: StreamingFinish, result: ShardResult) -> ShardFinished:
    """Validate and tokenize one generated shard (the stage body the flow runs once per shard)."""
    return stream.finish(result)


def close_validation(stream: StreamingFinish) -> ValidationSummary:
    """The validation summary over every shard."""
    return stream.close_validation()


def close_tokenization(stream: StreamingFinish) -> TokenizationSummary:
    """Final parquet names and the tokenization summary."""
    return stream.close_tokenization()
