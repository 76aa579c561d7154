"""Conversations and steps counted from checkpoint lines: the summary, the live tail, progress and the run report."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from datagen.conversation.turn_stats import StepTail, TurnSummary, conversations, is_step_row
from datagen.engine.stats import DispatcherStats
from datagen.operations import report
from datagen.records import Completion, Message, Reject


def step(
    pid: str,
    n: int,
    turn: int,
    tokens: int,
    *,
    prompt_tokens: int = 100,
    bridge: list[int] | None = None,
    outcome: str | None = None,
    source: str = "chat",
) -> Completion:
    """One every-turn checkpoint line, as the engine writes it (docs/conversations.md)."""
    return Completion(
        prompt_id=pid,
        source=source,
        row=0,
        messages=[Message("user", f"question {turn}")],
        request_key=f"key-{pid}:step-{n}",
        prompt_tokens=prompt_tokens,
        output_ids=list(range(tokens)),
        text="x" * tokens,
        finish_reason="length" if outcome == "truncated" else "stop",
        completion_tokens=tokens,
        step=n,
        turn_index=turn,
        bridge_ids=bridge,
        outcome=outcome,
    )


def reject(pid: str, n: int, reason: str) -> Reject:
    return Reject("generate", reason, f"turn of step {n}", "chat", prompt_id=pid, request_key=f"key-{pid}:step-{n}")


# conv a: 2 user turns, the first with a tool call and its continuation: complete.
# conv b: diverges on its first turn. conv c: step 0, then its step 1 refused (context). conv d: going on.
LINES = [
    step("a", 0, 0, 10, bridge=None),
    step("b", 0, 0, 40, outcome="tool_call_divergence"),
    step("a", 1, 0, 20, prompt_tokens=130, bridge=[1, 2, 3]),
    step("c", 0, 0, 30),
    step("a", 2, 1, 30, prompt_tokens=200, outcome="complete"),
    step("d", 0, 0, 5),
]
REJECTS = [reject("c", 1, "context_exceeded")]


def test_the_new_completion_fields_are_omitted_when_unset_and_read_back() -> None:
    line = step("p", 0, 0, 3).to_json()
    body = json.loads(line)
    assert list(body)[-2:] == ["step", "turn_index"] and "bridge_ids" not in body and "outcome" not in body
    # A `last` mode line (no step fields, a key naming no step) reads as its conversation's one step (step 0 of user
    # turn 0) and writes back byte for byte, without any of them.
    body["request_key"] = "p-key"
    legacy = json.dumps({k: v for k, v in body.items() if k not in ("step", "turn_index")}, ensure_ascii=False)
    read = Completion.from_json(legacy)
    assert (read.step, read.turn_index, read.bridge_ids, read.outcome) == (0, 0, None, None)
    assert read.to_json() == legacy
    back = Completion.from_json(step("p", 2, 1, 3, bridge=[7, 8], outcome="complete").to_json())
    assert (back.step, back.turn_index, back.bridge_ids, back.outcome) == (2, 1, [7, 8], "complete")
    assert is_step_row(json.loads(back.to_json())) and not is_step_row(json.loads(legacy))


def test_conversations_group_steps_and_name_why_each_ended() -> None:
    convs = conversations([json.loads(c.to_json()) for c in LINES], [json.loads(r.to_json()) for r in REJECTS])
    assert [s.step for s in convs["a"].steps] == [0, 1, 2]  # in step order, whatever the file order
    assert convs["a"].outcome == "complete" and convs["a"].turns == 2 and convs["a"].steps_per_turn() == [2, 1]
    assert convs["b"].outcome == "tool_call_divergence"
    assert convs["c"].outcome == "context_exceeded" and convs["c"].output_tokens == 30
    assert convs["d"].outcome is None
    # Rows: one per kept user-turn segment; its tokens = its last step's prompt + output.
    assert convs["a"].row_tokens() == [130 + 20, 200 + 30]
    assert convs["a"].row_tokens({"key-a:step-2"}) == [150]  # validation rejected turn 1's step
    assert convs["a"].row_tokens({"key-a:step-0"}) == []  # the first segment goes, and every one after it


def test_a_truncated_or_rejected_last_step_drops_its_segment_only() -> None:
    rows = [step("t", 0, 0, 10), step("t", 1, 1, 64, prompt_tokens=150, outcome="truncated")]
    assert conversations([json.loads(c.to_json()) for c in rows])["t"].row_tokens() == [110]
    rows[1] = step("t", 1, 1, 64, prompt_tokens=150, outcome="rejected_placeholder")
    assert conversations([json.loads(c.to_json()) for c in rows])["t"].row_tokens() == [110]


def test_a_reject_settled_again_by_a_completion_does_not_end_the_conversation() -> None:
    convs = conversations(
        [json.loads(step("r", 0, 0, 9, outcome="complete").to_json())],
        [json.loads(reject("r", 0, "server_error").to_json())],
    )
    assert convs["r"].outcome == "complete"


def test_turn_summary_measures_steps_turns_conversations_and_outcomes() -> None:
    convs = conversations([json.loads(c.to_json()) for c in LINES], [json.loads(r.to_json()) for r in REJECTS])
    summary = TurnSummary.of(convs.values())
    assert (summary.conversations, summary.finished, summary.steps, summary.user_turns) == (4, 3, 6, 5)
    assert summary.output_tokens_per_step["mean"] == round(135 / 6, 2)
    assert summary.output_tokens_per_conversation["max"] == 60
    assert summary.steps_per_user_turn["max"] == 2 and summary.user_turns_per_conversation["mean"] == 1.25
    assert summary.outcomes == {"complete": 1, "tool_call_divergence": 1, "context_exceeded": 1}
    assert summary.ended_early == {"tool_call_divergence": 0.3333, "context_exceeded": 0.3333}


def _write(path: Path, records: list[Any], torn: str = "") -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(r.to_json() + "\n" for r in records) + torn)


def test_step_tail_reads_only_committed_appended_lines(tmp_path: Path) -> None:
    comp, rej = tmp_path / "shard-00000.completions.jsonl", tmp_path / "shard-00000.rejects.jsonl"
    tail = StepTail([comp, tmp_path / "shard-00001.completions.jsonl"], [rej], planned=4)
    assert tail.poll().steps == 0  # no files yet
    torn = step("d", 1, 0, 7, bridge=[1]).to_json()
    _write(comp, LINES[:3], torn=torn[:20])  # a line being written: not counted yet
    counts = tail.poll()
    assert (counts.steps, counts.finished, counts.user_turns, counts.output_tokens) == (3, 1, 2, 70)
    with open(comp, "a", encoding="utf-8") as f:
        f.write(torn[20:] + "\n")
    _write(comp, LINES[3:])
    _write(rej, REJECTS)
    counts = tail.poll()
    assert (counts.steps, counts.finished, counts.user_turns) == (7, 3, 5)  # d1 continues its turn
    assert dict(counts.outcomes) == {"tool_call_divergence": 1, "complete": 1, "context_exceeded": 1}
    assert counts.ended_early == 2
    assert tail.poll() == counts  # nothing appended: the same counts


def _stats(elapsed: float, completed: int, tokens: int = 0) -> DispatcherStats:
    return DispatcherStats(
        elapsed_s=elapsed,
        submitted=completed,
        completed=completed,
        rejected=0,
        failed=0,
        retries=0,
        requeued=0,
        output_tokens=tokens,
        queued=0,
        in_flight=2,
        completions_per_s=0.0,
        output_tokens_per_s=tokens / elapsed,
        eta_s=None,
        servers=[],
    )


class _Dispatcher:
    def __init__(self, stats: DispatcherStats) -> None:
        self.snapshot = stats

    def stats(self) -> DispatcherStats:
        return self.snapshot


def test_progress_counts_conversations_and_steps_in_every_turn_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    comp, rej = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    _write(comp, LINES[:2])  # an earlier attempt finished conversation b
    dispatcher = _Dispatcher(_stats(10, 0))
    reporter = report.ProgressReporter(
        dispatcher,  # type: ignore[arg-type]
        total_prompts=4,
        already_settled=0,
        progress_artifact_id=None,
        logger=logging.getLogger("test.turns"),
        interval_s=3600,
        log_every_s=0,
        turns=StepTail([comp], [rej], planned=4),
    )
    _write(comp, LINES[2:])
    _write(rej, REJECTS)
    dispatcher.snapshot = _stats(20, 5, tokens=95)  # the dispatcher counts steps: 5 sent by this call
    with caplog.at_level(logging.INFO, logger="test.turns"):
        reporter.tick()
    line = caplog.records[-1].getMessage()
    assert "3 of 4 conversations finished (75%), 2 ended early, 6 steps (5 user turns) generated" in line, line
    # 2 conversations finished by this call in 20 s: 1 left at 0.1/s.
    assert "ETA 10.0 s" in line, line


def test_run_report_counts_conversations_in_every_turn_mode_and_last_mode_is_unchanged(tmp_path: Path) -> None:
    comp, rej = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    _write(comp, LINES)
    _write(rej, REJECTS)
    base: dict[str, Any] = dict(
        namespace="conv_v1",
        uri="s3://b/conv_v1/",
        dry_run=False,
        prompts=4,
        shards=1,
        rows=3,
        rejects=1,
        rejects_by_reason={"generate/context_exceeded": 1},
        output_tokens=135,
        dataset_bytes=1000,
        servers=1,
        generation_s=10.0,
        stages={"generation": 10.0},
        wall_s=12.0,
        lengths=[c.completion_tokens for c in LINES],
    )
    last = report.RunFacts(**base)
    assert "conversations" not in last.summary() and "conversation" not in report.run_report(last)
    assert "## Completion lengths" in report.run_report(last)
    every = report.RunFacts(**base, conversations=StepTail([comp], [rej], planned=4).poll())
    text = report.run_report(every)
    assert "| conversations planned | 4 |" in text
    assert "| conversations finished | 3 (1 complete, 2 ended early) |" in text
    assert "| steps generated (one generation each) | 6 |" in text
    assert "## Conversations by outcome" in text and "| tool_call_divergence | 1 | 33.3% |" in text
    assert "## Step lengths" in text
    assert every.summary()["conversations"] == {
        "conversations_planned": 4,
        "conversations_finished": 3,
        "steps": 6,
        "user_turns": 5,
        "conversations_by_outcome": {"tool_call_divergence": 1, "complete": 1, "context_exceeded": 1},
    }


def test_the_cli_summary_names_conversations_in_every_turn_mode(tmp_path: Path) -> None:
    from flows.cli import summary_text

    comp, rej = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    _write(comp, LINES)
    summary = {"uri": "s3://b/ns/", "namespace": "ns", "rows": 3, "rejects": 1, "prompts": 4}
    assert "from 4 prompts in namespace ns" in summary_text(summary)
    every = summary | {"conversations": StepTail([comp], [rej], planned=4).poll().summary()}
    assert "Published 3 rows (1 rejects) from 2 of 4 conversations (6 steps) in namespace ns" in summary_text(every)
