"""Shard claims, leases, checkpoint parts and done markers against the real local S3 server.

The checkpoint's way through the exchange (sync, restore on another box, done marker, collection, odd and corrupt
lines) runs in both turn modes (the `mode` fixture): a conversation of one step is a row of either mode, keyed
and written as its mode writes it (datagen/conversation/turn_mode.py). Claims, leases and plans never read the
mode. `turns: every` alone merges a conversation's step lines: it is settled when its kept chain of step lines
ends with an outcome or a reject line settles the step after it; two owners that both generated a step (a lease
taken over mid-conversation) leave two chains in the parts, and every reader keeps the same one.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.checkpoint import CheckpointError
from datagen.conversation.export import assistant_turn
from datagen.conversation.ledger import read_ledger
from datagen.conversation.regeneration import step_key
from datagen.conversation.turn_mode import EveryTurn, LastTurn, TurnMode, turn_mode
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Completion, Message, Reject
from datagen.runspec import ExchangeSpec, MultiBoxSpec, PromptSource, RunSpec
from datagen.sources.preparation import preparer_for, read_rendered, rendered_path
from tasks.generation import ShardResult
from tasks.planning import plan_shards
from tasks.shard_exchange import (
    CheckpointSync,
    ConversationMerge,
    IncompleteShard,
    RequestMerge,
    RunStateConflict,
    ShardExchange,
)


class Clock:
    """A settable clock: lease expiry without sleeping."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["last", "every"])
def mode(request: pytest.FixtureRequest) -> TurnMode:
    """Each turn mode."""
    return turn_mode(RunSpec(model_path="unused", turns=request.param))


def _row(mode: TurnMode, key: str, tokens: int = 5, text: str | None = None) -> str:
    """The checkpoint line of conversation `key` answered in one step, as `mode` writes it (JSON, not ASCII-escaped)."""
    c = Completion(
        prompt_id=f"p-{key}",
        source="s",
        row=0,
        messages=[Message(role="user", content=f"question {key}")],
        request_key=mode.step_key(key, 0),
        prompt_tokens=4,
        output_ids=[*range(10, 10 + tokens - 1), IM_END_ID],
        text=f"answer {key}" if text is None else text,
        finish_reason="stop",
        completion_tokens=tokens,
    )
    if mode.continues:  # the step fields: its first and last step, the conversation complete
        c.step, c.turn_index, c.outcome = 0, 0, "complete"
    return json.dumps(json.loads(c.to_json()), ensure_ascii=False)


def _reject_row(mode: TurnMode, key: str, reason: str) -> str:
    """The reject line of conversation `key`'s first step."""
    reject = Reject("generate", reason, f"{reason} detail", "s", 0, f"p-{key}", request_key=mode.step_key(key, 0))
    return reject.to_json()


def _keys(mode: TurnMode, *names: str) -> set[str]:
    """The request keys of the one-step conversations `names`."""
    return {mode.step_key(name, 0) for name in names}


# How collection names a conversation missing from a shard's parts, per mode.
MISSING = {"last": "1 of the shard's 6 are missing", "every": "1 of its 6 conversations are not settled"}


def _result(shard_id: int, n: int) -> ShardResult:
    return ShardResult(
        shard_id=shard_id,
        completions_path="-",
        rejects_path="-",
        n_prompts=n,
        n_completed=n,
        n_rejected=0,
        n_sent=n,
        output_tokens=0,
        completions_sha256="-",
    )


def _exchange(
    store: ObjectStore, box: str, clock: Clock, owner: str | None = None, mode: TurnMode | None = None
) -> ShardExchange:
    owner = owner or box.replace("-", "") + "owner"
    return ShardExchange(
        store, "ns_test", box, owner, lease_s=5.0, clock=clock, mode=mode or LastTurn(), enable_thinking=True
    )


def test_claims_are_exclusive_until_the_lease_lapses_then_taken_over(s3_store: ObjectStore) -> None:
    clock = Clock()
    a, b = _exchange(s3_store, "box-a", clock), _exchange(s3_store, "box-b", clock)
    lease_a = a.claim_next([0, 1], exclude=set())
    assert lease_a is not None and lease_a.shard_id == 0 and lease_a.seq == 1
    lease_b = b.claim_next([0, 1], exclude=set())
    assert lease_b is not None and lease_b.shard_id == 1  # shard 0 is held: b takes the next one

    clock.now += 3
    assert a.renew(lease_a) and lease_a.seq == 2  # a renewal is claim number 2, never a replaced object
    clock.now += 4
    assert b.try_claim(0) is None  # renewed lease still valid

    clock.now += 10  # a stops renewing (dead box): its lease lapses
    takeover = b.try_claim(0)
    assert takeover is not None and takeover.seq == 3
    assert not a.renew(lease_a) and lease_a.lost  # a comes back: number 3 is taken, it learns it lost
    assert [(c.seq, c.box) for c in a.claims(0)] == [(1, "box-a"), (2, "box-a"), (3, "box-b")]

    assert a.mark_done(_result(0, 0), None)
    assert b.claim_next([0], exclude=set()) is None  # done shards are never claimed again


def test_only_one_of_racing_boxes_wins_a_claim(s3_store: ObjectStore) -> None:
    clock = Clock()
    boxes = [_exchange(s3_store, f"box-{i}", clock) for i in range(4)]
    wins: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(boxes))  # all four ask at once

    def race(sx: ShardExchange) -> None:
        start.wait(timeout=30)
        if sx.try_claim(7) is not None:
            with lock:
                wins.append(sx.box)

    threads = [threading.Thread(target=race, args=(sx,)) for sx in boxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claims = boxes[0].claims(7)
    assert len(wins) == 1  # exactly one box owns the shard; the others see its live lease or lose the write
    assert [(c.seq, c.box) for c in claims] == [(1, wins[0])]  # one claim, number 1, by the winner
    late = [sx.try_claim(7) for sx in boxes if sx.box != wins[0]]  # losers that ask again while the lease lives
    assert late == [None, None, None] and len(boxes[0].claims(7)) == 1


def test_sync_uploads_complete_new_rows_as_parts_and_restore_resumes_elsewhere(
    s3_store: ObjectStore, tmp_path: Path, mode: TurnMode
) -> None:
    clock = Clock()
    a, b = _exchange(s3_store, "box-a", clock, mode=mode), _exchange(s3_store, "box-b", clock, mode=mode)
    layout_a, layout_b = RunLayout(tmp_path / "a"), RunLayout(tmp_path / "b")
    lease = a.try_claim(3)
    assert lease is not None
    path = layout_a.shard_completions(3)
    path.parent.mkdir(parents=True)
    path.write_text(
        _row(mode, "k1") + "\n" + _row(mode, "k2") + "\n" + _row(mode, "k3")[:10], encoding="utf-8"
    )  # torn last line

    sync = CheckpointSync(a, lease, layout_a, known_keys=set(), interval_s=60)
    assert sync.sync_once() == 2
    assert sync.sync_once() == 0  # nothing new: no empty parts
    with open(path, "a", encoding="utf-8") as f:
        f.write(_row(mode, "k3")[10:] + "\n")
    layout_a.shard_rejects(3).write_text(_reject_row(mode, "k4", "x") + "\n", encoding="utf-8")
    assert sync.sync_once() == 2
    parts = sorted(o.key for o in s3_store.list(a.parts_prefix(3)))
    assert len(parts) == 3 and all("part-box-a-boxaowner-" in k for k in parts)

    # Box b takes over: it gets every row a uploaded, plus its own earlier local rows; duplicates collapse.
    layout_b.shard_completions(3).parent.mkdir(parents=True)
    layout_b.shard_completions(3).write_text(_row(mode, "k2") + "\n" + _row(mode, "k5") + "\n", encoding="utf-8")
    layout_b.shard_rejects(3).write_text(_reject_row(mode, "k1", "y") + "\n", encoding="utf-8")
    known = b.restore_checkpoint(3, layout_b)
    assert known == _keys(mode, "k1", "k2", "k3", "k4")
    local = [json.loads(x)["request_key"] for x in layout_b.shard_completions(3).read_text().splitlines()]
    assert local == [mode.step_key(k, 0) for k in ("k1", "k2", "k3", "k5")]
    assert layout_b.shard_rejects(3).read_text().splitlines() == [_reject_row(mode, "k4", "x")]

    # b's first sync sends only what S3 lacks (k5); a duplicate part from a lagging a is deduped on read.
    lease_b = b.try_claim(3)
    assert lease_b is None  # a's lease is still valid
    clock.now += 60
    lease_b = b.try_claim(3)
    assert lease_b is not None
    sync_b = CheckpointSync(b, lease_b, layout_b, known, interval_s=60)
    assert sync_b.sync_once() == 1
    a.upload_part(3, "completions", [_row(mode, "k2"), _row(mode, "k5")], seq=99)
    rows = b.read_rows(3)
    assert sorted(rows.completions) == sorted(_keys(mode, "k1", "k2", "k3", "k5"))
    assert list(rows.rejects) == [mode.step_key("k4", 0)]
    assert rows.duplicates == 2
    assert rows.rows_by_box == {"box-a": 5}  # k5 twice: a's part sorts first, so a's row is the one kept

    with pytest.raises(IncompleteShard):
        b.mark_done(_result(3, 6), None)  # S3 holds 5 requests, not 6: no marker
    assert b.mark_done(_result(3, 5), "standin-1")
    assert not a.mark_done(_result(3, 5), None)  # second finisher: the marker exists, nothing replaced
    assert b.done_marker(3)["box"] == "box-b"

    # The shard's conversations: their keys (request keys in `last`), each one's prompt id.
    expected = {k: f"p-{k}" for k in ("k1", "k2", "k3", "k4", "k5")}
    collected = b.collect_shard(3, RunLayout(tmp_path / "parent"), expected)
    assert (collected.result.n_completed, collected.result.n_rejected) == (4, 1)
    with pytest.raises(IncompleteShard, match=MISSING[mode.name]):
        b.collect_shard(3, RunLayout(tmp_path / "parent2"), {**expected, "k6": "p-k6"})


def test_plan_upload_is_idempotent_and_refuses_a_different_plan(s3_store: ObjectStore, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(5)) + "\n"
    )
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))], shard_size=2, namespace="ns_test", model_path=str(ensure_model_dir())
    )
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout)
    sx = ShardExchange(s3_store, "ns_test", "parent", "p1", mode=turn_mode(spec))
    sx.publish_plan(plan, layout)
    sx.publish_plan(plan, layout)  # a re-run with the same prompts: accepted, nothing rewritten
    assert sx.fetch_plan() == plan
    assert sx.fetch_prompts(plan, 2, RunLayout(tmp_path / "box")).read_bytes() == layout.shard_prompts(2).read_bytes()

    other = plan_shards(spec.model_copy(update={"shard_size": 3}), RunLayout(tmp_path / "other"))
    with pytest.raises(RunStateConflict, match="new namespace"):
        sx.publish_plan(other, RunLayout(tmp_path / "other"))


def test_boxes_fetch_planning_render_with_the_prompts(s3_store: ObjectStore, tmp_path: Path) -> None:
    """A box sends the ids the parent's planning rendered instead of rendering each prompt again (issue 22)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i} " * (i + 1)}]}) for i in range(5)) + "\n"
    )
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))], shard_size=2, namespace="ns_test", model_path=str(ensure_model_dir())
    )
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout)
    sx = ShardExchange(s3_store, "ns_test", "parent", "p1", mode=turn_mode(spec))
    sx.publish_plan(plan, layout)
    sx.publish_plan(plan, layout)  # a re-run: the cache already there is kept
    assert s3_store.head(sx.render_cache_key(1)) is not None

    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    render_key = preparer_for(spec, chat).render_key
    box = RunLayout(tmp_path / "box")
    for entry in plan.shards:
        fetched = sx.fetch_prompts(plan, entry.shard_id, box)
        ids, parents = (
            read_rendered(fetched, render_key),
            read_rendered(layout.shard_prompts(entry.shard_id), render_key),
        )
        assert ids is not None and parents is not None
        assert [ids[r] for r in range(len(ids))] == [parents[r] for r in range(entry.n_prompts)]
        assert len(ids) == entry.n_prompts
    # A box whose render differs (thinking off here) does not take the parent's ids: it renders itself.
    assert (
        read_rendered(
            box.shard_prompts(0),
            preparer_for(
                spec.model_copy(update={"sampling": spec.sampling.model_copy(update={"enable_thinking": False})}), chat
            ).render_key,
        )
        is None
    )

    # A shard without an uploaded cache: the box keeps none (a stale local one is removed with a new download).
    other = ShardExchange(s3_store, "ns_nocache", "parent", "p1", mode=turn_mode(spec))
    rendered_path(layout.shard_prompts(0)).unlink()
    other.publish_plan(plan, layout)
    assert s3_store.head(other.render_cache_key(0)) is None
    box2 = RunLayout(tmp_path / "box2")
    box2.shard_prompts(0).parent.mkdir(parents=True)
    box2.shard_prompts(0).write_text("stale\n")
    rendered_path(box2.shard_prompts(0)).write_bytes(b"stale")
    other.fetch_prompts(plan, 0, box2)
    assert not rendered_path(box2.shard_prompts(0)).exists()
    assert read_rendered(box2.shard_prompts(0), render_key) is None


def test_an_exchange_takes_the_runs_turn_mode_never_a_default(s3_store: ObjectStore) -> None:
    # A default mode contradicted the run's (`RunSpec.turns` defaults to every turn): rows merged by the wrong unit.
    with pytest.raises(TypeError, match="mode"):
        ShardExchange(s3_store, "ns_test", "parent", "p1")
    with pytest.raises(TypeError):  # keyword only: never a positional slip after `clock`
        ShardExchange(s3_store, "ns_test", "parent", "p1", 120.0, Clock(), LastTurn())
    every = ShardExchange(s3_store, "ns_test", "parent", "p1", mode=turn_mode(RunSpec(model_path="unused")))
    last = ShardExchange(
        s3_store, "ns_test", "parent", "p1", mode=turn_mode(RunSpec(model_path="unused", turns="last"))
    )
    assert isinstance(every.merge, ConversationMerge) and isinstance(last.merge, RequestMerge)


def test_specs_reject_leases_renewed_too_late_and_bad_box_names() -> None:
    with pytest.raises(ValueError, match="half of lease_s"):
        ExchangeSpec(lease_s=5, sync_interval_s=3)
    with pytest.raises(ValueError, match="box names"):
        MultiBoxSpec(boxes=["box a"])
    with pytest.raises(ValueError, match="unique"):
        MultiBoxSpec(boxes=["a", "a"])


def test_a_row_holding_line_separators_crosses_the_exchange_whole_and_a_corrupt_line_is_named(
    s3_store: ObjectStore, tmp_path: Path, mode: TurnMode
) -> None:
    clock = Clock()
    a, b = _exchange(s3_store, "box-a", clock, mode=mode), _exchange(s3_store, "box-b", clock, mode=mode)
    lease = a.try_claim(4)
    assert lease is not None
    layout_a = RunLayout(tmp_path / "a")
    path = layout_a.shard_completions(4)
    path.parent.mkdir(parents=True)
    # The checkpoint writes JSON with ensure_ascii=False: U+2028, U+0085 and \x1c reach the file unescaped.
    odd = _row(mode, "k1", 2, text="a\u2028b\x85c\x1cd")
    assert "\u2028" in odd and "\x85" in odd  # raw in the line (\x1c is escaped: JSON allows no control)
    path.write_text(odd + "\n" + _row(mode, "k2") + "\n", encoding="utf-8")
    sync = CheckpointSync(a, lease, layout_a, known_keys=set(), interval_s=60)
    assert sync.sync_once() == 2
    rows = b.read_rows(4)
    assert rows.completions == {mode.step_key("k1", 0): odd, mode.step_key("k2", 0): _row(mode, "k2")}
    known = b.restore_checkpoint(4, RunLayout(tmp_path / "b"))
    assert known == _keys(mode, "k1", "k2")
    assert (
        RunLayout(tmp_path / "b").shard_completions(4).read_text(encoding="utf-8")
        == odd + "\n" + _row(mode, "k2") + "\n"
    )

    with open(path, "a", encoding="utf-8") as f:
        f.write("{not json\n")
    with pytest.raises(CheckpointError, match=r"shard-00004\.completions\.jsonl:3: not a JSON object"):
        sync.sync_once()
    a.upload_part(4, "completions", [_row(mode, "k3"), "[1, 2]"], seq=7)
    with pytest.raises(CheckpointError, match=r"part-box-a-boxaowner-000007\.jsonl:2: not a JSON object but a list"):
        b.read_rows(4)


# --- `turns: every` alone: a conversation's step lines, merged into one chain ----------------------------------

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


def _steps_chain(conv: str, answers: list[str], outcome: str | None) -> list[Completion]:
    steps: list[Completion] = []
    for i, answer in enumerate(answers):
        steps.append(_step(conv, i, answer, steps, outcome if i == len(answers) - 1 else None))
    return steps


def _step_reject(conv: str, step: int) -> str:
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


def _every_exchange(store: ObjectStore, box: str) -> ShardExchange:
    return ShardExchange(store, "ns_every", box, box.replace("-", "") + "owner", mode=EveryTurn(), enable_thinking=True)


def _every_done(sx: ShardExchange) -> None:
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
    a = _every_exchange(s3_store, "box-a")
    # conv-a ended (complete at step 2); conv-b has steps 0 and 1 but neither an outcome nor a reject.
    a.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kA", ["x", "y", "z"], "complete")], 1)
    a.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kB", ["p", "q"], None)], 2)
    with pytest.raises(IncompleteShard, match=r"settle 1 of 2 conversations"):
        _every_done(a)
    # Even with a done marker (a box of an older version wrote it), collection checks every conversation.
    s3_store.put_if_absent(a.done_key(SHARD), b"{}")
    with pytest.raises(IncompleteShard, match=r"1 of its 2 conversations are not settled.*conv-b \(2 step lines"):
        a.collect_shard(SHARD, RunLayout(tmp_path / "parent"), CONVERSATIONS)

    # The step after conv-b's last line is rejected: now both are settled, and the shard collects.
    a.upload_part(SHARD, "rejects", [_step_reject("kB", 2)], 3)
    collected = a.collect_shard(SHARD, RunLayout(tmp_path / "parent2"), CONVERSATIONS)
    result = collected.result
    assert (result.n_prompts, result.n_completed, result.n_rejected) == (2, 5, 1)
    assert collected.conflicts == [] and collected.duplicates_dropped == 0


def test_a_takeover_mid_conversation_keeps_one_chain_per_conversation(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Box b ("box-b" sorts after "box-a") wrote steps 0-1 of conv-a and kept working after box a took the lease over:
    # box a resumed at step 2 from those lines, box b wrote its own step 2 and stopped (no outcome).
    a, b = _every_exchange(s3_store, "box-a"), _every_exchange(s3_store, "box-b")
    before = _steps_chain("kA", ["x", "y"], None)
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
    a.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kB", ["p"], "complete")], 2)
    _every_done(a)

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
    a, b = _every_exchange(s3_store, "box-a"), _every_exchange(s3_store, "box-b")
    a.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kA", ["x", "a1", "a2", "a3"], None)], 1)
    b.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kA", ["x", "b1"], "complete")], 1)
    b.upload_part(SHARD, "completions", [c.to_json() for c in _steps_chain("kB", ["p"], None)], 2)
    b.upload_part(SHARD, "rejects", [_step_reject("kB", 1)], 3)
    rows = a.read_rows(SHARD)
    assert rows.settled == set(CONVERSATIONS)
    kept = [Completion.from_json(line) for line in rows.completions.values()]
    assert [(c.prompt_id, c.step, c.text.rsplit("\n", 1)[-1]) for c in kept] == [
        ("conv-a", 0, "x"),
        ("conv-a", 1, "b1"),
        ("conv-b", 0, "p"),
    ]
    assert rows.rows_by_box == {"box-a": 1, "box-b": 3}  # step 0 was generated alike twice: a's part comes first
    _every_done(b)
