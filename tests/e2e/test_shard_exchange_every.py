"""`turns: every` rows in the shard exchange: a step line per key, merged per conversation (real local S3 server).

A conversation is settled when its kept chain of step lines ends with an outcome or a reject line settles the
step after it; two owners that both generated a step (a lease taken over mid-conversation) leave two chains in
the parts, and every reader keeps the same one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.conversation.export import assistant_turn
from datagen.conversation.ledger import read_ledger
from datagen.conversation.regeneration import step_key
from datagen.conversation.turn_mode import EveryTurn
from datagen.layout import RunLayout
from datagen.publishing.storage import ObjectStore
from datagen.records import Completion, Message, Reject
from tasks.generation import ShardResult
from tasks.shard_exchange import IncompleteShard, ShardExchange

SHARD = 2
CONVERSATIONS = {"kA": "conv-a", "kB": "conv-b"}  # conversation request key -> prompt id


def _step(conv: str, step: int, answer: str, before: list[Completion], outcome: str | None = None) -> Completion:
    """Step `step` of conversation `conv`: one user turn per step, its history the earlier steps' answers."""
    messages: list[Message] = []
    for i, c in enumerate(before):
        messages += [Message(role="user", content=f"question {i}"), assistant_turn(c, True)]
    messages.append(Message(role="user", content=f"question {step}"))
    return Completion(
        prompt_id=CONVERSATIONS[conv],
        source="conv",
        row=0,
        messages=messages,
        request_key=step_key(conv, step),
        prompt_tokens=10 + step,
        output_ids=[len(answer), step],
        text=f"<think>\nr\n</think>\n\n{answer}",
        finish_reason="stop",
        completion_tokens=2,
        step=step,
        turn_index=step,
        outcome=outcome,
    )


def _chain(conv: str, answers: list[str], outcome: str | None) -> list[Completion]:
    steps: list[Completion] = []
    for i, answer in enumerate(answers):
        steps.append(_step(conv, i, answer, steps, outcome if i == len(answers) - 1 else None))
    return steps


def _reject(conv: str, step: int) -> str:
    key = step_key(conv, step)
    reject = Reject(
        stage="generate",
        reason="server_rejected",
        detail="refused",
        source="conv",
        row=0,
        prompt_id=CONVERSATIONS[conv],
        request_key=key,
    )
    return reject.to_json()


def _exchange(store: ObjectStore, box: str) -> ShardExchange:
    return ShardExchange(store, "ns_every", box, box.replace("-", "") + "owner", mode=EveryTurn(), enable_thinking=True)


def _done(sx: ShardExchange) -> None:
    result = ShardResult(
        shard_id=SHARD,
        completions_path="-",
        rejects_path="-",
        n_prompts=len(CONVERSATIONS),
        n_completed=0,
        n_rejected=0,
        n_sent=0,
        output_tokens=0,
        completions_sha256="-",
    )
    sx.mark_done(result, None)


def test_collect_refuses_a_shard_whose_conversation_misses_steps(s3_store: ObjectStore, tmp_path: Path) -> None:
    a = _exchange(s3_store, "box-a")
    # conv-a ended (complete at step 2); conv-b has steps 0 and 1 but neither an outcome nor a reject.
    a.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kA", ["x", "y", "z"], "complete")], 1)
    a.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kB", ["p", "q"], None)], 2)
    with pytest.raises(IncompleteShard, match=r"settle 1 of 2 conversations"):
        _done(a)
    # Even with a done marker (a box of an older version wrote it), collection checks every conversation.
    s3_store.put_if_absent(a.done_key(SHARD), b"{}")
    with pytest.raises(IncompleteShard, match=r"1 of its 2 conversations are not settled.*conv-b \(2 step lines"):
        a.collect_shard(SHARD, RunLayout(tmp_path / "parent"), CONVERSATIONS)

    # The step after conv-b's last line is rejected: now both are settled, and the shard collects.
    a.upload_part(SHARD, "rejects", [_reject("kB", 2)], 3)
    collected = a.collect_shard(SHARD, RunLayout(tmp_path / "parent2"), CONVERSATIONS)
    result = collected.result
    assert (result.n_prompts, result.n_completed, result.n_rejected) == (2, 5, 1)
    assert collected.conflicts == [] and collected.duplicates_dropped == 0


def test_a_takeover_mid_conversation_keeps_one_chain_per_conversation(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Box b ("box-b" sorts after "box-a") wrote steps 0-1 of conv-a and kept working after box a took the lease over:
    # box a resumed at step 2 from those lines, box b wrote its own step 2 and stopped (no outcome).
    a, b = _exchange(s3_store, "box-a"), _exchange(s3_store, "box-b")
    before = _chain("kA", ["x", "y"], None)
    b.upload_part(SHARD, "completions", [c.to_json() for c in before], 1)
    b_step2 = _step("kA", 2, "b's answer", before)
    b.upload_part(SHARD, "completions", [b_step2.to_json()], 2)

    # Box a takes over: its restore keeps b's chain (the only one) in step order and resumes after step 2.
    layout_a = RunLayout(tmp_path / "box-a")
    layout_a.shard_completions(SHARD).parent.mkdir(parents=True, exist_ok=True)
    known = a.restore_checkpoint(SHARD, layout_a)
    assert known == {step_key("kA", i) for i in range(3)}
    ledgers = read_ledger(layout_a.shard_completions(SHARD), layout_a.shard_rejects(SHARD), set(CONVERSATIONS))
    assert len(ledgers["kA"].lines) == 3 and not ledgers["kA"].settled

    # Yet say box a had resumed from steps 0-1 only (b's step 2 came later): its step 2 and 3 differ from b's.
    a_step2 = _step("kA", 2, "a's answer", before)
    a_step3 = _step("kA", 3, "a's end", [*before, a_step2], "complete")
    a.upload_part(SHARD, "completions", [a_step2.to_json(), a_step3.to_json()], 1)
    a.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kB", ["p"], "complete")], 2)
    _done(a)

    # a's parts sort first and its chain is settled: steps 0-1 of b's, 2-3 of a's. b's step 2 is dropped, by name.
    collected = a.collect_shard(SHARD, RunLayout(tmp_path / "parent"), CONVERSATIONS)
    lines = [Completion.from_json(line) for line in Path(collected.result.completions_path).read_text().splitlines()]
    conv_a = [c for c in lines if c.prompt_id == "conv-a"]
    assert [(c.step, c.text.rsplit("\n", 1)[-1]) for c in conv_a] == [
        (0, "x"),
        (1, "y"),
        (2, "a's answer"),
        (3, "a's end"),
    ]
    assert collected.rows_by_box == {"box-a": 3, "box-b": 2}
    assert collected.duplicates_dropped == 1
    assert len(collected.conflicts) == 1
    assert "conv-a" in collected.conflicts[0] and "steps 2, boxes box-b" in collected.conflicts[0]

    # The same pick from either box's reader, and after a rerun of the box that lost (its restore agrees).
    assert b.read_rows(SHARD).completions == a.read_rows(SHARD).completions
    layout_b = RunLayout(tmp_path / "box-b")
    layout_b.shard_completions(SHARD).parent.mkdir(parents=True, exist_ok=True)
    layout_b.shard_completions(SHARD).write_text("".join(c.to_json() + "\n" for c in [*before, b_step2]))
    b.restore_checkpoint(SHARD, layout_b)
    assert layout_b.shard_completions(SHARD).read_bytes() == Path(collected.result.completions_path).read_bytes()


def test_an_unsettled_longer_chain_loses_to_a_settled_one(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Box a's chain of conv-a stops at step 3 unsettled; box b's is shorter but ended: b's is kept.
    a, b = _exchange(s3_store, "box-a"), _exchange(s3_store, "box-b")
    a.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kA", ["x", "a1", "a2", "a3"], None)], 1)
    b.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kA", ["x", "b1"], "complete")], 1)
    b.upload_part(SHARD, "completions", [c.to_json() for c in _chain("kB", ["p"], None)], 2)
    b.upload_part(SHARD, "rejects", [_reject("kB", 1)], 3)
    rows = a.read_rows(SHARD)
    assert rows.settled == set(CONVERSATIONS)
    kept = [Completion.from_json(line) for line in rows.completions.values()]
    assert [(c.prompt_id, c.step, c.text.rsplit("\n", 1)[-1]) for c in kept] == [
        ("conv-a", 0, "x"),
        ("conv-a", 1, "b1"),
        ("conv-b", 0, "p"),
    ]
    assert rows.rows_by_box == {"box-a": 1, "box-b": 3}  # step 0 was generated alike twice: a's part comes first
    _done(b)
