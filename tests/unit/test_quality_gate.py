"""The dataset-level gate: the placeholder incident and the narrow-mix incident must both stop a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.checks.quality import (
    QualityGateError,
    TokenDistribution,
    ValidationSummary,
    check_load_gate,
    check_quality_gate,
    render_validation_report,
)
from datagen.conversation.turn_mode import LastTurn
from datagen.identity import prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion
from datagen.runspec import QualityGate, ValidationSpec
from tasks.validation import validate_shards

GATE = QualityGate()
REAL_ANSWER = (
    "Tides come from the Moon's gravity pulling unevenly on the Earth: the near side is pulled harder than "
    "the centre, the far side less, so water bulges on both sides. As the planet turns beneath those bulges, "
    "most coasts see two high and two low tides a day, with springs at new and full moon."
)


def summary_of(
    lengths: dict[int, int], sources: dict[str, int], categories: dict[str, int] | None = None
) -> ValidationSummary:
    """An all-accepted summary with the given loss-token counts and mix."""
    n = sum(lengths.values())
    return ValidationSummary(
        total=n,
        accepted=n,
        loss_tokens=TokenDistribution(counts=dict(lengths)),
        answer_tokens=TokenDistribution(counts=dict(lengths)),
        accepted_by_source=sources,
        accepted_by_category=categories or {"(none)": n},
        finish_reasons={"stop": n},
    )


def test_distribution_percentiles_and_shares() -> None:
    d = TokenDistribution()
    for v in [1, 2, 3, 4, 100]:
        d.add(v)
    assert (d.percentile(50), d.percentile(100), d.percentile(1)) == (3, 100, 1)
    assert d.share_at_most(3) == pytest.approx(0.6)
    assert d.mean == pytest.approx(22.0)
    assert d.histogram()[:4] == [(0, 1, 0), (1, 2, 1), (2, 4, 2), (4, 8, 1)]
    assert sum(c for _, _, c in d.histogram()) == 5


def test_healthy_dataset_passes() -> None:
    s = summary_of({400: 300, 1200: 400, 3000: 300}, {"a": 400, "b": 350, "c": 250}, {"code": 300, "chat": 700})
    report = check_quality_gate(s, QualityGate(max_source_share=0.5, max_category_share=0.8))
    assert report.passed, report.text
    report.raise_if_failed()
    assert "quality gate PASSED" in report.text


def test_placeholder_incident_87_percent_at_6_loss_tokens_fails() -> None:
    s = summary_of({6: 870, 900: 130}, {"sharegpt": 1000})
    report = check_quality_gate(s, GATE)
    assert not report.passed
    failed = {c.name for c in report.failures}
    assert failed == {"short_share", "median_completion_tokens"}
    assert "87.0% of samples have <= 16 loss tokens" in report.text
    # The report shows the spike that gives the incident away.
    assert "6 tokens: 870 (87.0%)" in report.text
    with pytest.raises(QualityGateError, match="short_share") as err:
        report.raise_if_failed()
    assert err.value.report is report


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def _placeholder_shard(chat: ChatTokenizer, path: Path, n: int, n_real: int) -> Path:
    """n thinking-off completions, all but n_real of them the placeholder 'OK.'."""
    lines = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Conversation {i}: tell me something."}]
        text = "OK." if i >= n_real else f"Answer {i}. {REAL_ANSWER}"
        ids = [*chat.encode(text), IM_END_ID]
        pid = prompt_id_from_messages("sharegpt", messages)
        c = Completion(pid, "sharegpt", i, messages, f"rk-{pid}", 20, ids, text, "stop", len(ids))
        lines.append(c.to_json())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_placeholder_set_through_validation_trips_the_gate_either_way(chat: ChatTokenizer, tmp_path: Path) -> None:
    shard = _placeholder_shard(chat, tmp_path / "shard-00000.completions.jsonl", 100, 13)
    # Default spec: the placeholders are rejected one by one, and the reject rate stops the run.
    strict = validate_shards([shard], tmp_path / "strict", ValidationSpec(), enable_thinking=False, turns=LastTurn())
    report = check_quality_gate(strict, GATE)
    assert [c.name for c in report.failures] == ["reject_rate"]
    assert "validate/placeholder=87 (87.0%)" in report.text
    # Identical placeholders are also duplicates; with both per-sample checks off the distribution still stops it.
    lax_spec = ValidationSpec(min_answer_tokens=0, reject_duplicate_completions=False)
    lax = validate_shards([shard], tmp_path / "lax", lax_spec, enable_thinking=False, turns=LastTurn())
    assert lax.accepted == 100
    report = check_quality_gate(lax, GATE)
    assert {c.name for c in report.failures} == {"short_share", "median_completion_tokens"}
    assert "3 tokens: 87 (87.0%)" in report.text  # "OK" "." <|im_end|>


def test_80_percent_one_source_fails_with_the_mix() -> None:
    s = summary_of({800: 1000}, {"codealpaca": 800, "nemotron": 150, "infinity": 50})
    report = check_quality_gate(s, QualityGate(max_source_share=0.5))
    assert [c.name for c in report.failures] == ["source_share"]
    assert "largest is 'codealpaca' with 800/1000 = 80.0% (limit 50.0%)" in report.text
    assert "codealpaca=800 (80.0%), nemotron=150 (15.0%), infinity=50 (5.0%)" in report.text


def test_category_share_ignores_unlabelled_samples() -> None:
    s = summary_of({800: 1000}, {"a": 1000}, {"coding": 770, "(none)": 230})
    report = check_quality_gate(s, QualityGate(max_category_share=0.5))
    assert [c.name for c in report.failures] == ["category_share"]
    assert "'coding' with 770/1000 = 77.0%" in report.text
    unlabelled = check_quality_gate(summary_of({800: 10}, {"a": 10}), QualityGate(max_category_share=0.5))
    assert unlabelled.passed, unlabelled.text


def test_reject_rate_counts_upstream_and_downstream_rejects() -> None:
    s = summary_of({800: 100}, {"a": 100})
    assert check_quality_gate(s, GATE, upstream_rejects=25).passed  # 25/125 = 20%
    report = check_quality_gate(s, GATE, upstream_rejects=25, downstream_rejects=1)
    assert [c.name for c in report.failures] == ["reject_rate"]
    assert "26/125 rejected" in report.text
    assert "load+generate (reasons not given)=25 (20.0%), tokenize (reasons not given)=1 (0.8%)" in report.text


def test_gate_names_every_reject_reason_with_its_count() -> None:
    # Issue 23.6: tokenize rejects were summed as "tokenize=3", whatever their reasons.
    s = summary_of({800: 10}, {"a": 10})
    upstream = {"load/invalid_json": 2, "generate/server_rejected": 1}
    downstream = {"tokenize/prompt_decode_mismatch": 2, "tokenize/completion_decode_mismatch": 1}
    report = check_quality_gate(s, GATE, 3, 3, upstream, ["r.jsonl"], downstream)
    assert not report.passed
    line = next(e for e in report.evidence if "rejects by reason" in e)
    for reason, count in {**upstream, **downstream}.items():
        assert f"{reason}={count} (" in line
    assert "tokenize=" not in line and "reasons not given" not in line


def test_reject_rate_evidence_names_upstream_reasons_and_reject_files() -> None:
    # Issue 13.3: reasons by name, not `load/generate=11`, and where the rows are.
    s = summary_of({800: 100}, {"a": 100})
    upstream = {"load/unknown_format": 20, "load/invalid_json": 5, "generate/prompt_too_long": 6}
    report = check_quality_gate(s, GATE, 31, upstream_reasons=upstream, reject_paths=["/w/load-rejects.jsonl"])
    assert not report.passed
    assert "load/unknown_format=20 (15.3%), generate/prompt_too_long=6 (4.6%), load/invalid_json=5" in report.text
    assert "load/generate" not in report.text
    assert "/w/load-rejects.jsonl" in report.text


def test_load_gate_fails_before_generation_with_reasons_counts_and_file() -> None:
    # Issue 13.2/13.3: every row rejected, or too many, fails on the plan alone.
    all_bad = check_load_gate(12, 0, {"unknown_format": 10, "missing_field": 2}, GATE, "/w/load-rejects.jsonl")
    assert not all_bad.passed
    assert [c.name for c in all_bad.failures] == ["usable_prompts", "load_reject_rate"]
    assert "all 12 rows read were rejected at load" in all_bad.text
    assert "unknown_format=10 (83.3%), missing_field=2 (16.7%)" in all_bad.text
    assert "/w/load-rejects.jsonl" in all_bad.text
    quarter = check_load_gate(40, 30, {"invalid_json": 10}, GATE, "/w/r.jsonl")
    assert [c.name for c in quarter.failures] == ["load_reject_rate"]
    assert "10/40 rows rejected at load = 25.0%" in quarter.text
    assert check_load_gate(40, 35, {"invalid_json": 5}, GATE, "/w/r.jsonl").passed
    assert check_load_gate(0, 0, {}, GATE, "/w/r.jsonl").passed  # nothing new to read is not bad input


def test_an_expansion_is_judged_on_its_new_rejects_over_the_rows_it_read() -> None:
    # Issue 35.1: rows skipped as published count in the denominator, old rejects nowhere.
    grown = check_load_gate(7, 5, {"invalid_json": 2}, GATE, "/w/r.jsonl", n_skipped_published=40, n_old_rejects=11)
    assert grown.passed
    assert "2/47 rows rejected at load (7 new rows and 40 published before; 11 rejects published before not " in (
        grown.checks[-1].message
    )
    # Only broken rows are new: not "all rows read were rejected" (the source was published from before).
    only_bad = check_load_gate(1, 0, {"invalid_json": 1}, GATE, "/w/r.jsonl", n_skipped_published=40)
    assert only_bad.passed
    assert not check_load_gate(8, 0, {"invalid_json": 8}, GATE, "/w/r.jsonl", n_skipped_published=30).passed


def test_empty_dataset_fails() -> None:
    report = check_quality_gate(ValidationSummary(total=5, rejected=5, reject_reasons={"truncated": 5}), GATE)
    assert not report.passed
    assert "no accepted samples out of 5" in report.text


def test_report_gives_each_reasons_share_and_a_few_examples(chat: ChatTokenizer, tmp_path: Path) -> None:
    # Issue 13.4: the report shows the share of each reason and up to three example rows per reason.
    shard = _placeholder_shard(chat, tmp_path / "shard-00000.completions.jsonl", 20, 15)
    summary = validate_shards([shard], tmp_path / "out", ValidationSpec(), enable_thinking=False, turns=LastTurn())
    assert summary.reject_reasons == {"placeholder": 5}
    assert len(summary.reject_samples["placeholder"]) == 3
    md = render_validation_report(summary)
    row = next(line for line in md.splitlines() if line.startswith("| placeholder |"))
    assert row.startswith("| placeholder | 5 | 25.0% | ") and row.count("<br>") == 2
    assert row.count("(prompt ") == 3 and "'OK.'" in row


def test_error_accepts_plain_text() -> None:
    err = QualityGateError("quality gate FAILED (1 check(s))")
    assert err.report is None and "FAILED" in str(err)


def test_markdown_report_shows_verdict_histogram_and_mix() -> None:
    s = summary_of({6: 870, 900: 130}, {"sharegpt": 1000}, {"chat": 1000})
    s.total, s.rejected = 1010, 10
    s.reject_reasons, s.reject_examples = {"truncated": 10}, {"truncated": "cut at the token limit after 8192 tokens"}
    md = render_validation_report(s, check_quality_gate(s, GATE))
    assert "**FAILED**: quality gate" in md
    assert "| short_share | **FAIL** | 0.87 | <= 0.05 |" in md
    assert "| truncated | 10 | 1.0% | cut at the token limit after 8192 tokens |" in md
    hist = [line for line in md.splitlines() if line.strip().startswith("4-7")]
    assert hist and hist[0].rstrip().endswith("#" * 40)  # the 870 samples at 6 tokens fill the widest bar
    assert "| sharegpt | 1000 | 100.0% |" in md and "| chat | 1000 | 100.0% |" in md
