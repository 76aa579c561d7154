"""Length prediction, long-first ordering (in memory and spilled), and selection: skips, targets, pilot sample."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from datagen.identity import prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt, Reject
from datagen.runspec import PromptSource, RunSpec
from tasks.ordering import LengthModel, LengthSample, long_first, long_first_filter, run_filter
from tasks.planning import plan_shards
from tasks.selection import choose, stratified_sample


def _prompt(source: str, n: int, category: str | None = None, text: str = "") -> Prompt:
    messages = [{"role": "user", "content": text or f"{source} question {n}"}]
    return Prompt(prompt_id_from_messages(source, messages), source, n, messages, category)


def _model() -> LengthModel:
    samples = [
        *(LengthSample(source="code", category="hard", prompt_chars=40, output_tokens=4000) for _ in range(30)),
        *(LengthSample(source="code", category="easy", prompt_chars=40, output_tokens=1000) for _ in range(30)),
        *(LengthSample(source="chat", category=None, prompt_chars=40, output_tokens=200) for _ in range(30)),
    ]
    return LengthModel.fit(samples)


def test_length_model_learns_source_and_category_means_with_shrinkage() -> None:
    model = _model()
    assert model.global_mean == pytest.approx((4000 + 1000 + 200) / 3)
    hard, easy, chat = (
        model.predict(_prompt("code", 1, "hard")),
        model.predict(_prompt("code", 2, "easy")),
        model.predict(_prompt("chat", 3)),
    )
    assert hard > easy > chat
    # 30 samples against 5 pseudo-samples: the category mean dominates but is pulled toward its source's.
    assert 3500 < hard < 4000 and 1000 < easy < 1500
    # An unseen source gets the global mean; an unseen category its source's (shrunk) mean.
    assert model.predict(_prompt("new", 4)) == pytest.approx(model.global_mean)
    assert model.predict(_prompt("code", 5, "unseen")) == pytest.approx(
        (60 * 2500 + 5 * model.global_mean) / 65, rel=1e-6
    )


def test_length_model_fits_prompt_length_exponent() -> None:
    # Output tokens proportional to prompt length within one source: the fitted exponent is close to 1.
    samples = [
        LengthSample(source="s", category=None, prompt_chars=c, output_tokens=c * 3) for c in range(100, 3100, 100)
    ]
    model = LengthModel.fit(samples)
    assert model.slope == pytest.approx(1.0, abs=0.05)
    short, long = _prompt("s", 1, text="x" * 200), _prompt("s", 2, text="x" * 2000)
    assert model.predict(long) / model.predict(short) == pytest.approx(10, rel=0.1)
    assert LengthModel.fit(samples[:5]).slope == 0.0  # too few samples: no exponent


def test_long_first_orders_by_prediction_keeps_ties_and_passes_rejects(tmp_path: Path) -> None:
    model = _model()
    items: list[Prompt | Reject] = []
    for i in range(12):
        items.append(_prompt(["chat", "code", "code"][i % 3], i, [None, "easy", "hard"][i % 3]))
        if i == 5:
            items.append(Reject(stage="load", reason="malformed_row", detail="line 7", source="chat", row=7))
    in_memory = list(long_first(items, model, tmp_path / "spill-a"))
    spilled = list(long_first(items, model, tmp_path / "spill-b", run=5))
    assert in_memory == spilled
    assert isinstance(in_memory[0], Reject)  # load rejects are not delayed by the sort
    order = [p for p in in_memory if isinstance(p, Prompt)]
    assert [p.category for p in order] == ["hard"] * 4 + ["easy"] * 4 + [None] * 4
    assert [p.row for p in order] == [2, 5, 8, 11, 1, 4, 7, 10, 0, 3, 6, 9]  # ties keep input order
    assert not (tmp_path / "spill-b").exists()  # spill runs are removed


def test_a_spilled_sort_keeps_each_prompt_s_rendered_ids(tmp_path: Path) -> None:
    prompts = [_prompt("code", i) for i in range(7)]
    for i, p in enumerate(prompts):
        p.input_ids = array("i", [248045, i, 70000 + i, 248046])  # planning writes these beside the shard
    spilled = [p for p in long_first(prompts, _model(), tmp_path / "spill", run=3) if isinstance(p, Prompt)]
    assert {p.row: list(p.input_ids or []) for p in spilled} == {i: [248045, i, 70000 + i, 248046] for i in range(7)}


def test_planning_writes_shards_longest_expected_first(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "category": ["easy", "hard"][i % 2]} for i in range(8)]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = RunSpec(
        sources=[PromptSource(path=str(path), category_field="category")],
        shard_size=4,
        model_path=str(ensure_model_dir()),
    )
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout, select=long_first_filter(_model(), tmp_path / "spill"))
    first = [Prompt.from_json(line).category for line in layout.shard_prompts(0).read_text().splitlines()]
    second = [Prompt.from_json(line).category for line in layout.shard_prompts(1).read_text().splitlines()]
    assert plan.n_prompts == 8 and first == ["hard"] * 4 and second == ["easy"] * 4


def test_choose_skips_published_and_takes_seeded_sample_under_caps() -> None:
    items: list[Prompt | Reject] = [_prompt("big", i, "math" if i % 2 else "code") for i in range(100)]
    items += [_prompt("small", i, "code") for i in range(10)]
    published = {p.prompt_id for p in items[:20] if isinstance(p, Prompt)}
    selection, report = choose(items, published, source_targets={"big": 30}, category_targets={"code": 25}, seed=3)
    kept = [p for p in items if isinstance(p, Prompt) and selection.keeps(p)]
    assert not {p.prompt_id for p in kept} & published
    assert sum(p.source == "big" for p in kept) == 30
    assert sum(p.category == "code" for p in kept) <= 25
    assert report.skipped_published == 20 and report.n_selected == len(kept)
    assert report.available_by_source == {"big": 100, "small": 10}
    again, _ = choose(items, published, source_targets={"big": 30}, category_targets={"code": 25}, seed=3)
    other, _ = choose(items, published, source_targets={"big": 30}, category_targets={"code": 25}, seed=4)
    assert again.capped_taken == selection.capped_taken != other.capped_taken


def test_stratified_sample_is_proportional_with_a_floor_per_source() -> None:
    items: list[Prompt | Reject] = [_prompt("a", i) for i in range(900)] + [_prompt("b", i) for i in range(100)]
    items.append(_prompt("c", 0))
    ids, population, allocated = stratified_sample(items, lambda p: True, size=100, seed=1, min_per_source=5)
    assert population == {"a": 900, "b": 100, "c": 1}
    assert allocated == {"a": 90, "b": 10, "c": 1}
    assert len(ids) == 101
    same, _, _ = stratified_sample(list(reversed(items)), lambda p: True, size=100, seed=1, min_per_source=5)
    assert same == ids  # the sample follows the ids, not the file order


def test_run_filter_needs_a_model_for_long_first(tmp_path: Path) -> None:
    spec = RunSpec(pilot="p", order="long_first")
    with pytest.raises(ValueError, match="length model"):
        run_filter(spec, set(), tmp_path)
    with pytest.raises(ValueError, match="needs a pilot"):
        RunSpec(order="long_first")
