"""Shard claims, leases, checkpoint parts and done markers against the real local S3 server."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointError
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.runspec import ExchangeSpec, MultiBoxSpec, PromptSource, RunSpec
from datagen.sources.preparation import preparer_for, read_rendered, rendered_path
from tasks.generation import ShardResult
from tasks.planning import plan_shards
from tasks.shard_exchange import (
    CheckpointSync,
    IncompleteShard,
    RunStateConflict,
    ShardExchange,
)


class Clock:
    """A settable clock: lease expiry without sleeping."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _row(key: str, tokens: int = 5) -> str:
    return json.dumps({"request_key": key, "completion_tokens": tokens, "text": f"answer {key}"})


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


def _exchange(store: ObjectStore, box: str, clock: Clock, owner: str | None = None) -> ShardExchange:
    return ShardExchange(store, "ns_test", box, owner or box.replace("-", "") + "owner", lease_s=5.0, clock=clock)


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
    s3_store: ObjectStore, tmp_path: Path
) -> None:
    clock = Clock()
    a, b = _exchange(s3_store, "box-a", clock), _exchange(s3_store, "box-b", clock)
    layout_a, layout_b = RunLayout(tmp_path / "a"), RunLayout(tmp_path / "b")
    lease = a.try_claim(3)
    assert lease is not None
    path = layout_a.shard_completions(3)
    path.parent.mkdir(parents=True)
    path.write_text(_row("k1") + "\n" + _row("k2") + "\n" + _row("k3")[:10], encoding="utf-8")  # torn last line

    sync = CheckpointSync(a, lease, layout_a, known_keys=set(), interval_s=60)
    assert sync.sync_once() == 2
    assert sync.sync_once() == 0  # nothing new: no empty parts
    with open(path, "a", encoding="utf-8") as f:
        f.write(_row("k3")[10:] + "\n")
    layout_a.shard_rejects(3).write_text(json.dumps({"request_key": "k4", "reason": "x"}) + "\n", encoding="utf-8")
    assert sync.sync_once() == 2
    parts = sorted(o.key for o in s3_store.list(a.parts_prefix(3)))
    assert len(parts) == 3 and all("part-box-a-boxaowner-" in k for k in parts)

    # Box b takes over: it gets every row a uploaded, plus its own earlier local rows; duplicates collapse.
    layout_b.shard_completions(3).parent.mkdir(parents=True)
    layout_b.shard_completions(3).write_text(_row("k2") + "\n" + _row("k5") + "\n", encoding="utf-8")
    layout_b.shard_rejects(3).write_text(json.dumps({"request_key": "k1", "reason": "y"}) + "\n", encoding="utf-8")
    known = b.restore_checkpoint(3, layout_b)
    assert known == {"k1", "k2", "k3", "k4"}
    local = [json.loads(x)["request_key"] for x in layout_b.shard_completions(3).read_text().splitlines()]
    assert local == ["k1", "k2", "k3", "k5"]
    assert layout_b.shard_rejects(3).read_text().splitlines() == [json.dumps({"request_key": "k4", "reason": "x"})]

    # b's first sync sends only what S3 lacks (k5); a duplicate part from a lagging a is deduped on read.
    lease_b = b.try_claim(3)
    assert lease_b is None  # a's lease is still valid
    clock.now += 60
    lease_b = b.try_claim(3)
    assert lease_b is not None
    sync_b = CheckpointSync(b, lease_b, layout_b, known, interval_s=60)
    assert sync_b.sync_once() == 1
    a.upload_part(3, "completions", [_row("k2"), _row("k5")], seq=99)
    rows = b.read_rows(3)
    assert sorted(rows.completions) == ["k1", "k2", "k3", "k5"] and list(rows.rejects) == ["k4"]
    assert rows.duplicates == 2
    assert rows.rows_by_box == {"box-a": 5}  # k5 twice: a's part sorts first, so a's row is the one kept

    with pytest.raises(IncompleteShard):
        b.mark_done(_result(3, 6), None)  # S3 holds 5 requests, not 6: no marker
    assert b.mark_done(_result(3, 5), "standin-1")
    assert not a.mark_done(_result(3, 5), None)  # second finisher: the marker exists, nothing replaced
    assert b.done_marker(3)["box"] == "box-b"

    collected = b.collect_shard(3, RunLayout(tmp_path / "parent"), {"k1", "k2", "k3", "k4", "k5"})
    assert (collected.result.n_completed, collected.result.n_rejected) == (4, 1)
    with pytest.raises(IncompleteShard, match="1 of the shard's 6 are missing"):
        b.collect_shard(3, RunLayout(tmp_path / "parent2"), {"k1", "k2", "k3", "k4", "k5", "k6"})


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
    sx = ShardExchange(s3_store, "ns_test", "parent", "p1")
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
    sx = ShardExchange(s3_store, "ns_test", "parent", "p1")
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
    other = ShardExchange(s3_store, "ns_nocache", "parent", "p1")
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


def test_specs_reject_leases_renewed_too_late_and_bad_box_names() -> None:
    with pytest.raises(ValueError, match="half of lease_s"):
        ExchangeSpec(lease_s=5, sync_interval_s=3)
    with pytest.raises(ValueError, match="box names"):
        MultiBoxSpec(boxes=["box a"])
    with pytest.raises(ValueError, match="unique"):
        MultiBoxSpec(boxes=["a", "a"])


def test_a_row_holding_line_separators_crosses_the_exchange_whole_and_a_corrupt_line_is_named(
    s3_store: ObjectStore, tmp_path: Path
) -> None:
    clock = Clock()
    a, b = _exchange(s3_store, "box-a", clock), _exchange(s3_store, "box-b", clock)
    lease = a.try_claim(4)
    assert lease is not None
    layout_a = RunLayout(tmp_path / "a")
    path = layout_a.shard_completions(4)
    path.parent.mkdir(parents=True)
    # The checkpoint writes JSON with ensure_ascii=False: U+2028, U+0085 and \x1c reach the file unescaped.
    odd = json.dumps({"request_key": "k1", "completion_tokens": 2, "text": "a\u2028b\x85c\x1cd"}, ensure_ascii=False)
    path.write_text(odd + "\n" + _row("k2") + "\n", encoding="utf-8")
    sync = CheckpointSync(a, lease, layout_a, known_keys=set(), interval_s=60)
    assert sync.sync_once() == 2
    rows = b.read_rows(4)
    assert rows.completions == {"k1": odd, "k2": _row("k2")}
    known = b.restore_checkpoint(4, RunLayout(tmp_path / "b"))
    assert known == {"k1", "k2"}
    assert RunLayout(tmp_path / "b").shard_completions(4).read_text(encoding="utf-8") == odd + "\n" + _row("k2") + "\n"

    with open(path, "a", encoding="utf-8") as f:
        f.write("{not json\n")
    with pytest.raises(CheckpointError, match=r"shard-00004\.completions\.jsonl:3: not a JSON object"):
        sync.sync_once()
    a.upload_part(4, "completions", [_row("k3"), "[1, 2]"], seq=7)
    with pytest.raises(CheckpointError, match=r"part-box-a-boxaowner-000007\.jsonl:2: not a JSON object but a list"):
        b.read_rows(4)
