"""The every-turn shard ledger (tasks/generation_turns.read_ledger): which conversations a checkpoint settles, and
which checkpoints this shard cannot have written."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.checkpoint import CheckpointError
from datagen.records import Completion, Reject
from tasks.generation_turns import read_ledger

KEYS = {"ka", "kb", "kc", "kd"}


def _step(key: str, n: int, outcome: str | None = None, turn: int = 0) -> str:
    c = Completion("p-" + key, "s", 0, [], f"{key}:step-{n}", 3, [1], "x", "stop", 1, step=n, turn_index=turn)
    c.outcome = outcome
    return c.to_json() + "\n"


def _reject(key: str, n: int) -> str:
    return Reject(
        "generate", "server_rejected", "d", "s", prompt_id="p-" + key, request_key=f"{key}:step-{n}"
    ).to_json()


def _files(tmp_path: Path, completions: list[str], rejects: list[str]) -> tuple[Path, Path]:
    comp, rej = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    comp.write_text("".join(completions))
    rej.write_text("".join(r + "\n" for r in rejects))
    return comp, rej


def test_settled_conversations_and_where_the_others_resume(tmp_path: Path) -> None:
    # a: ended on step 1; b: step 0 written, step 1 refused by the server; c: two steps, not ended; d: nothing.
    completions = [_step("ka", 0), _step("kc", 0), _step("kb", 0), _step("ka", 1, "complete", 1), _step("kc", 1)]
    # A torn last line (a crash mid-write) is not a step.
    comp, rej = _files(tmp_path, [*completions, _step("kc", 2)[:30]], [_reject("kb", 1)])
    ledgers = read_ledger(comp, rej, KEYS)
    assert {k: (len(v.lines), v.settled) for k, v in ledgers.items()} == {
        "ka": (2, True),
        "kb": (1, True),
        "kc": (2, False),
    }
    assert [turn for _, turn, _, _ in ledgers["ka"].lines] == [0, 1]
    # The offsets point at each line, so a resume reads only the lines it needs.
    _, _, offset, length = ledgers["kc"].lines[1]
    assert comp.read_bytes()[offset : offset + length].decode() == _step("kc", 1)


@pytest.mark.parametrize(
    ("completions", "rejects", "message"),
    [
        ([_step("ka", 0), _step("ka", 0)], [], "step 0 of conversation p-ka after 1 step lines"),
        ([_step("ka", 1)], [], "step 1 of conversation p-ka after 0 step lines"),
        ([_step("ka", 0, "complete"), _step("ka", 1)], [], "after 1 step lines and its outcome"),
        ([_step("ka", 0)], [_reject("ka", 0)], "a reject of step 0 of conversation p-ka, which has 1 step lines"),
        ([_step("ka", 0, "truncated")], [_reject("ka", 1)], "which has 1 step lines, an outcome"),
        ([], [_reject("ka", 0), _reject("ka", 0)], "and another reject"),
        ([_step("other", 0)], [], "1 lines that are no step of a conversation of this shard"),
        ([_step("ka", 0).replace("ka:step-0", "ka")], [], "1 lines that are no step"),  # a `last` mode key
    ],
)
def test_a_checkpoint_this_shard_did_not_write_is_refused(
    tmp_path: Path, completions: list[str], rejects: list[str], message: str
) -> None:
    comp, rej = _files(tmp_path, completions, rejects)
    with pytest.raises(CheckpointError, match=message):
        read_ledger(comp, rej, KEYS)
