"""Shard planning: shard files, load rejects and the plan manifest; determinism, idempotence, counts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt, Reject
from datagen.runspec import PromptSource, RunSpec
from datagen.sources.prompts import PromptSourceError
from tasks.planning import ShardPlan, plan_manifest_path, plan_shards, read_plan

REPO = Path(__file__).resolve().parents[2]


def write_rows(path: Path, n: int, start: int = 0, bad_every: int = 0) -> Path:
    """n rows of Alpaca prompts; every bad_every-th row (1-based) is invalid JSON."""
    lines = []
    for i in range(start, start + n):
        if bad_every and (i + 1) % bad_every == 0:
            lines.append("{not json")
        else:
            lines.append(json.dumps({"instruction": f"question {i}", "category": "even" if i % 2 == 0 else "odd"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def spec_for(*paths: Path, shard_size: int = 3) -> RunSpec:
    return RunSpec(
        sources=[PromptSource(path=str(p), category_field="category") for p in paths],
        shard_size=shard_size,
        model_path=str(ensure_model_dir()),  # a run's prompt ids are rendered: planning needs the model's tokenizer
    )


def files_of(layout: RunLayout) -> dict[str, bytes]:
    return {str(p.relative_to(layout.root)): p.read_bytes() for p in sorted(layout.root.rglob("*")) if p.is_file()}


def stat_of(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_shards_rejects_and_counts(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 9, bad_every=4)  # rows 4 and 8 are bad: 7 prompts
    b = write_rows(tmp_path / "b.jsonl", 4, start=100)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a, b), layout)

    assert plan.shard_ids == [0, 1, 2, 3]
    assert [s.n_prompts for s in plan.shards] == [3, 3, 3, 2]
    assert plan.n_prompts == 11
    assert plan.n_load_rejects == 2
    assert plan.n_rows == 13 == plan.n_prompts + plan.n_load_rejects
    assert plan.prompts_by_source == {"a": 7, "b": 4}
    assert plan.load_rejects_by_source == {"a": 2}
    assert plan.load_rejects_by_reason == {"invalid_json": 2}
    assert plan.prompts_by_category == {"even": 7, "odd": 4}
    assert plan.n_uncategorized == 0

    shard_prompts = [
        [Prompt.from_json(line) for line in layout.shard_prompts(i).read_text().splitlines()] for i in plan.shard_ids
    ]
    flat = [p for shard in shard_prompts for p in shard]
    assert [p.messages[0].content for p in flat] == [f"question {i}" for i in (0, 1, 2, 4, 5, 6, 8, 100, 101, 102, 103)]
    assert len({p.prompt_id for p in flat}) == 11
    rejects = [Reject.from_json(line) for line in layout.load_rejects.read_text().splitlines()]
    assert [(r.source, r.row, r.detail.split(": ")[0]) for r in rejects] == [("a", 3, f"{a}:4"), ("a", 7, f"{a}:8")]
    assert read_plan(layout) == plan
    assert not [p for p in layout.root.rglob("*.tmp")]


def test_plan_is_deterministic(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 10, bad_every=3)
    first, second = RunLayout(tmp_path / "one"), RunLayout(tmp_path / "two")
    plan_one = plan_shards(spec_for(a), first)
    plan_two = plan_shards(spec_for(a), second)
    assert plan_one == plan_two
    assert files_of(first) == files_of(second)
    assert set(files_of(first)) == {
        "load-rejects.jsonl",
        "shards/plan.json",
        "shards/shard-00000.prompts.jsonl",
        "shards/shard-00001.prompts.jsonl",
        "shards/shard-00002.prompts.jsonl",
        # planning's render of each shard's prompts, for generation (datagen.sources.preparation)
        "shards/shard-00000.input-ids.arrow",
        "shards/shard-00001.input-ids.arrow",
        "shards/shard-00002.input-ids.arrow",
        # the work dir's prompt id scheme, fixed by its first plan (tasks.planning.id_scheme)
        "prompt-id-scheme",
    }


def test_rerun_keeps_identical_files_untouched(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 10, bad_every=5)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a), layout)
    paths = [*(layout.shard_prompts(i) for i in plan.shard_ids), layout.load_rejects, plan_manifest_path(layout)]
    before = {p: stat_of(p) for p in paths}
    again = plan_shards(spec_for(a), layout)
    assert again == plan
    assert {p: stat_of(p) for p in paths} == before


def test_changed_input_rewrites_only_what_changed(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 9)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a), layout)
    kept = stat_of(layout.shard_prompts(0))

    # Change row 4 (shard 1) and drop the last three rows (shard 2).
    lines = a.read_text().splitlines()
    lines[4] = json.dumps({"instruction": "a different question", "category": "even"})
    a.write_text("\n".join(lines[:6]) + "\n")
    changed = plan_shards(spec_for(a), layout)

    assert changed.shard_ids == [0, 1]
    assert changed.shards[0] == plan.shards[0]
    assert changed.shards[1].sha256 != plan.shards[1].sha256
    assert changed.plan_sha256 != plan.plan_sha256
    assert stat_of(layout.shard_prompts(0)) == kept
    assert "a different question" in layout.shard_prompts(1).read_text()
    assert not layout.shard_prompts(2).exists()
    assert read_plan(layout) == changed


def test_tampered_shard_is_detected_and_rewritten(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 6)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a), layout)
    good = layout.shard_prompts(1).read_bytes()
    layout.shard_prompts(1).write_bytes(good.replace(b"question 4", b"question X"))

    assert read_plan(layout) is None
    assert read_plan(layout, verify=False) == plan
    assert plan_shards(spec_for(a), layout) == plan
    assert layout.shard_prompts(1).read_bytes() == good
    assert read_plan(layout) == plan


def test_no_prompts_gives_an_empty_plan_with_a_rejects_file(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    a.write_text("{bad\n\n[1]\n")
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a), layout)
    assert plan.shard_ids == []
    assert plan.n_prompts == 0
    assert plan.n_rows == plan.n_load_rejects == 2
    assert plan.load_rejects_by_reason == {"invalid_json": 1, "not_an_object": 1}
    assert len(layout.load_rejects.read_text().splitlines()) == 2


def test_config_error_leaves_an_existing_plan_alone(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 4)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec_for(a), layout)
    before = files_of(layout)
    with pytest.raises(PromptSourceError, match=r"missing\.jsonl"):
        plan_shards(spec_for(a, tmp_path / "missing.jsonl"), layout)
    assert files_of(layout) == before
    assert read_plan(layout) == plan


def test_failure_mid_stream_leaves_no_manifest_and_no_temp_files(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 6)
    b = tmp_path / "b.parquet"
    b.write_bytes(b"corrupt")  # found at resolution, unreadable only when reached
    layout = RunLayout(tmp_path / "run")
    plan_shards(spec_for(a), layout)
    a.write_text(a.read_text().replace("question 0", "question zero"))
    with pytest.raises(PromptSourceError, match=r"b\.parquet: not a readable parquet file"):
        plan_shards(spec_for(a, b), layout)
    # Shard 0 changed before the failure, so the old manifest no longer describes the files.
    assert not plan_manifest_path(layout).exists()
    assert read_plan(layout) is None
    assert not [p for p in layout.root.rglob("*.tmp")]


def test_plan_round_trips_as_json(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", 5)
    plan = plan_shards(spec_for(a, shard_size=2), RunLayout(tmp_path / "run"))
    assert ShardPlan.model_validate_json(plan.model_dump_json()) == plan
    assert plan_manifest_path(RunLayout(tmp_path / "run")).read_text() == plan.model_dump_json(indent=2) + "\n"


def test_bundled_set_plans_with_default_sources(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "run")
    spec = RunSpec(shard_size=100, model_path=str(ensure_model_dir()))
    plan = plan_shards(spec, layout, base_dir=REPO)
    assert plan.n_load_rejects == 0
    assert plan.n_prompts == sum(plan.prompts_by_source.values()) == sum(s.n_prompts for s in plan.shards)
    assert len(plan.prompts_by_source) == 6
    assert plan.shard_ids == list(range((plan.n_prompts + 99) // 100))
    assert os.path.getsize(layout.load_rejects) == 0


# ------------------------------------------------------------- identity from the rendered tokens (#13.5, #13.7)


def _model_spec(path: Path, **kw: object) -> RunSpec:
    from datagen.local.model_fixture import ensure_model_dir

    return RunSpec(
        sources=[PromptSource(path=str(path))],
        model_path=str(ensure_model_dir()),
        shard_size=10,
        **kw,  # type: ignore[arg-type]
    )


def _prompts(layout: RunLayout, plan: ShardPlan) -> list[Prompt]:
    return [
        Prompt.from_json(line)
        for sid in plan.shard_ids
        for line in layout.shard_prompts(sid).read_text(encoding="utf-8").splitlines()
    ]


def test_prompts_differing_only_in_whitespace_are_one_prompt_the_first_kept(tmp_path: Path) -> None:
    # Issue 13.5: whitespace variants got different ids though the template renders them to the same tokens.
    from datagen.chat import ChatTokenizer
    from datagen.identity import content_prompt_id

    f = tmp_path / "ws.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Explain tides."}]},
        {"messages": [{"role": "user", "content": "  Explain tides.\n"}]},
        {"messages": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Explain tides."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\tExplain tides."}]},
        {"messages": [{"role": "user", "content": "Explain  tides."}]},  # inner whitespace is rendered: new prompt
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = _model_spec(f)
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout)
    prompts = _prompts(layout, plan)
    assert [p.row for p in prompts] == [0, 2, 4]
    rejects = [Reject.from_json(line) for line in layout.load_rejects.read_text().splitlines()]
    assert [(r.reason, r.row, r.prompt_id) for r in rejects] == [
        ("duplicate_prompt", 1, prompts[0].prompt_id),
        ("duplicate_prompt", 3, prompts[1].prompt_id),
    ]
    chat = ChatTokenizer.from_model_dir(spec.model_path)
    for p in prompts:  # the id is what the model sees: the token ids apply_chat_template gives, and nothing else
        assert p.prompt_id == content_prompt_id(chat.render(p.messages))


def test_huge_row_is_rejected_as_too_long_without_being_tokenized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 13.7: a 50 MB line took 57 s and 6.9 GB to tokenize before it was rejected as too long.
    from datagen.chat import ChatTokenizer
    from datagen.runspec import SamplingSpec

    f = tmp_path / "huge.jsonl"
    big = "word " * 1_000_000  # 5 MB of content
    f.write_text(
        json.dumps({"instruction": "short one"}) + "\n" + json.dumps({"instruction": big}) + "\n", encoding="utf-8"
    )
    encoded: list[int] = []
    real_encode = ChatTokenizer.encode

    def spy(self: ChatTokenizer, text: str) -> list[int]:
        encoded.append(len(text))
        return real_encode(self, text)

    monkeypatch.setattr(ChatTokenizer, "encode", spy)
    spec = _model_spec(f, context_length=8192, sampling=SamplingSpec(max_new_tokens=4096))
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout)
    assert plan.n_prompts == 1 and plan.load_rejects_by_reason == {"prompt_too_long": 1}
    [reject] = [Reject.from_json(line) for line in layout.load_rejects.read_text().splitlines()]
    assert (reject.row, reject.location) == (1, f"{f}:2")
    assert "4999999 characters of content cannot fit in 4096 prompt tokens" in reject.detail
    assert "without tokenizing" in reject.detail
    assert max(encoded) < 1000  # only the short row was ever tokenized


def test_planning_writes_each_shard_s_render_and_a_stale_one_is_not_used(tmp_path: Path) -> None:
    from datagen.chat import ChatTokenizer
    from datagen.identity import PromptIdentity
    from datagen.sources.preparation import read_rendered

    a = write_rows(tmp_path / "a.jsonl", 7)
    layout = RunLayout(tmp_path / "run")
    spec = spec_for(a, shard_size=3)
    plan = plan_shards(spec, layout)
    key = PromptIdentity.for_spec(spec).preparer.render_key
    chat = ChatTokenizer.shared(spec.model_path)
    for shard_id in plan.shard_ids:
        path = layout.shard_prompts(shard_id)
        prompts = [Prompt.from_json(line) for line in path.read_text().splitlines()]
        cache = read_rendered(path, key)
        assert cache is not None and len(cache) == len(prompts)
        assert [cache[i] for i in range(len(prompts))] == [chat.prompt_ids(p.messages) for p in prompts]
    assert read_rendered(layout.shard_prompts(0), key.replace("thinking=True", "thinking=False")) is None
    path = layout.shard_prompts(1)
    path.write_text(path.read_text().replace("question 3", "question three"))  # edited after planning
    assert read_rendered(path, key) is None


def test_plan_counts_rows_in_the_sources_before_selection(tmp_path: Path) -> None:
    # Issue 23.6: an empty source and a source whose every prompt is skipped both planned 0 rows; only the
    # count before selection tells them apart (the report then says "the sources are empty").
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    plan = plan_shards(spec_for(empty), RunLayout(tmp_path / "run-empty"))
    assert (plan.n_rows, plan.n_rows_in_sources) == (0, 0)
    full = write_rows(tmp_path / "full.jsonl", 5)
    skip_all = plan_shards(
        spec_for(full), RunLayout(tmp_path / "run-skip"), select=lambda items: (i for i in items if False)
    )
    assert (skip_all.n_rows, skip_all.n_rows_in_sources) == (0, 5)
    again = read_plan(RunLayout(tmp_path / "run-skip"))
    assert again is not None and again.n_rows_in_sources == 5


def test_every_turn_checks_the_first_request_against_the_budget_not_the_recorded_conversation(tmp_path: Path) -> None:
    """Every turn: a conversation longer than the prompt budget whose first request fits is planned, with the id
    it has in `last` mode; one whose first user turn is over the budget, or whose recording is over the whole
    context, is a load reject saying which."""
    from datagen.identity import PromptIdentity
    from datagen.records import Message
    from datagen.runspec import SamplingSpec

    answer = "A long recorded answer about rivers and their deltas. " * 60  # about 600 tokens
    long_chat = [
        {"role": "user", "content": "Tell me about rivers."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And about lakes?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Which is deeper?"},
    ]
    huge_first = [
        {"role": "user", "content": "word " * 2000},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "More?"},
    ]
    over_context = [*long_chat[:-1]] * 4 + [{"role": "user", "content": "Done?"}]
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (long_chat, huge_first, over_context)))
    budget = {"context_length": 4096, "sampling": SamplingSpec(max_new_tokens=3072)}  # prompt budget: 1024 tokens

    last = plan_shards(_model_spec(f, turns="last", **budget), RunLayout(tmp_path / "last"))
    assert last.n_prompts == 0 and last.load_rejects_by_reason == {"prompt_too_long": 3}

    layout = RunLayout(tmp_path / "every")
    every_spec = _model_spec(f, turns="every", **budget)
    every = plan_shards(every_spec, layout)
    assert every.n_prompts == 1 and every.load_rejects_by_reason == {"prompt_too_long": 2}
    [prompt] = _prompts(layout, every)
    assert prompt.row == 0 and len(prompt.messages) == 5
    # Its id hashes what every turn sends the model (the user turns, not the recorded reply), so it is not the `last`
    # mode's id (the whole recorded prompt, where a bigger budget lets it through)...
    roomy = PromptIdentity.for_spec(_model_spec(f, turns="last", context_length=8192, sampling=budget["sampling"]))
    assert prompt.prompt_id != roomy.prompt_id(prompt.source, [Message(**m) for m in long_chat])
    every_roomy = PromptIdentity.for_spec(
        _model_spec(f, turns="every", context_length=8192, sampling=budget["sampling"])
    )
    assert prompt.prompt_id == every_roomy.prompt_id("another label", [Message(**m) for m in long_chat])
    # ... and the legacy id it is matched by in catalogs written before issue 47 is the whole recorded prompt's.
    assert (
        roomy.identify(prompt.source, [Message(**m) for m in long_chat]).alias
        == every_roomy.identify(prompt.source, [Message(**m) for m in long_chat]).alias
    )
    first, whole = (Reject.from_json(line) for line in layout.load_rejects.read_text().splitlines())
    assert first.row == 1 and first.detail.startswith(f"{f}:2: first request (messages through the first user turn)")
    assert "limit is 1024" in first.detail
    assert whole.row == 2 and "turns: every; the conversation as recorded must fit the model's context_length 4096" in (
        whole.detail
    )
