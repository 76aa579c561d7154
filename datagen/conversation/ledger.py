"""What a shard's checkpoint holds of each conversation: its step lines (where they are) and whether it is settled.

The checkpoint (datagen.checkpoint) is an exactly-once ledger keyed by step (`TurnMode.step_key`): a
conversation is settled by a line that ends it (`TurnMode.ends`: every `last` line, an every-turn line with an
`outcome`) or by a generation reject line; any other conversation with lines resumes at its first unwritten step.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from datagen.checkpoint import CheckpointError, read_lines, read_rows
from datagen.conversation.turn_mode import EveryTurn, TurnMode

__all__ = ["Ledger", "read_ledger"]


@dataclass(slots=True)
class Ledger:
    """What a shard's checkpoint holds of one conversation: its step lines (where they are) and how it ended."""

    lines: list[tuple[int, int, int, int]] = field(default_factory=list)  # (step, turn_index, offset, length)
    ended: bool = False  # its last step line ends it
    rejected_step: int | None = None  # the step a generation reject line settled

    @property
    def settled(self) -> bool:
        return self.ended or self.rejected_step is not None


def read_ledger(
    completions_path: Path, rejects_path: Path, conversation_keys: set[str], mode: TurnMode | None = None
) -> dict[str, Ledger]:
    """Each conversation's lines in the shard's checkpoint under `mode` (default: every turn); CheckpointError
    when they do not fit the shard.

    Foreign lines (no step of a conversation of this shard under this spec and model), a key written twice, steps
    not 0, 1, 2, ... in order, a line after the one that ended the conversation, or a reject beside a line that
    ended it or beside a later step: each is a checkpoint this shard did not write.
    """
    mode = mode if mode is not None else EveryTurn()
    ledgers: dict[str, Ledger] = collections.defaultdict(Ledger)
    foreign = 0
    for line in read_lines(completions_path):
        row = line.row(completions_path)
        split = mode.split_key(str(row.get("request_key", "")))
        if split is None or split[0] not in conversation_keys:
            foreign += 1
            continue
        ledger = ledgers[split[0]]
        if split[1] != len(ledger.lines) or ledger.ended:
            raise CheckpointError(
                f"{completions_path}:{line.lineno}: step {split[1]} of conversation {row.get('prompt_id')} after "
                f"{len(ledger.lines)} step lines{' and its outcome' if ledger.ended else ''}: steps are written "
                "once, in order"
            )
        ledger.lines.append((split[1], int(row.get("turn_index") or 0), line.offset, line.length))
        ledger.ended = mode.ends(row)
    for row in read_rows(rejects_path):
        split = mode.split_key(str(row.get("request_key", "")))
        if split is None or split[0] not in conversation_keys:
            foreign += 1
            continue
        ledger = ledgers[split[0]]
        if ledger.rejected_step is not None or ledger.ended or split[1] != len(ledger.lines):
            raise CheckpointError(
                f"{rejects_path}: a reject of step {split[1]} of conversation {row.get('prompt_id')}, which has "
                f"{len(ledger.lines)} step lines{', an outcome' if ledger.ended else ''}"
                f"{' and another reject' if ledger.rejected_step is not None else ''}: both completed and rejected"
            )
        ledger.rejected_step = split[1]
    if foreign:
        raise CheckpointError(
            f"{completions_path.name}/{rejects_path.name} hold {foreign} lines that are no step of a conversation "
            "of this shard under this spec and model (turns, sampling, model or template changed?); use a new "
            "namespace instead of mixing"
        )
    return dict(ledgers)
