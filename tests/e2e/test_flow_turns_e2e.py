"""Every turn through the whole `expand-dataset` flow: the bundled multi-turn, tool-calling prompt files (OpenAI and
ShareGPT forms), stand-in server processes that sometimes answer with a tool call, the real local S3 server.

Judged from what is published alone: every token row is the real template's `apply_chat_template(..., tools=...)` of
the published conversation cut at its user turn, loss on exactly the assistant turns the model wrote; every
conversation ends with a named outcome or a reject row; the manifest, the card and the flow's summary count
conversations and turns.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from datagen.chat import ChatTokenizer
from datagen.layout import RunLayout
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Completion
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from flows.cli import summary_text
from flows.expand_dataset import expand_dataset
from flows.pilot import pilot_flow
from tasks.pilot import PILOT_MARKDOWN, PilotSpec
from tests.turn_fixtures import check_published_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "data/prompts/tool_calls_openai.jsonl", REPO / "data/prompts/tool_calls_sharegpt.jsonl"]
# Why a conversation ends (docs/conversations.md, "Outcomes"): generation's, and validation's cuts.
OUTCOMES = {
    "complete",
    "truncated",
    "tool_call_divergence",
    "tool_call_missing",
    "unexpected_tool_call",
    "context_exceeded",
    "render_mismatch",
}
# Load reasons a row with tools or tool turns was refused for before conversations were supported.
TOOL_REASONS = {"unsupported_role", "bad_tools", "bad_tool_call", "bad_tool_turn"}


def _published(store: ObjectStore, namespace: str, local: Path) -> Path:
    """Download the published namespace to `local`."""
    for o in store.list(f"{namespace}/"):
        dest = local / o.key.removeprefix(f"{namespace}/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(store.get_bytes(o.key))
    return local


def _spec(namespace: str) -> RunSpec:
    return RunSpec(
        sources=[PromptSource(path=str(p), category_field="category") for p in SOURCES],
        model_path=str(ensure_model_dir()),
        namespace=namespace,
        turns="every",
        shard_size=8,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=8),
    )


def _lines(paths: list[Path]) -> set[bytes]:
    return {line for p in paths for line in p.read_bytes().splitlines() if line.strip()}


def test_every_turn_run_publishes_rows_equal_to_the_template_of_its_conversations(
    prefect_api: None, pipeline_env: dict[str, str], local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0.5")
    model_dir = ensure_model_dir()
    summary = expand_dataset(_spec("turns_v1"))

    work = Path(pipeline_env["DATAGEN_WORK_DIR"])
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    local = _published(store, "turns_v1", work / "dl")
    rows = pq.read_table(sorted((local / "data").glob("*.parquet"))).to_pylist()
    rejects = pq.read_table(sorted((local / "rejects").glob("*.parquet"))).to_pylist()
    lines = [
        json.loads(line)
        for f in sorted((local / "conversations").glob("conversations-*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]

    # None rejected for having tools or tool turns: every row of both files was loaded.
    assert [r for r in rejects if r["stage"] == "load" or r["reason"] in TOOL_REASONS] == []

    # Generation went step by step: keys `<key>:step-N`, steps of a conversation 0, 1, 2, ... in turn order.
    steps = [
        Completion.from_json(line)
        for f in (work / "runs" / "turns_v1" / "shards").glob("*.completions.jsonl")
        for line in f.read_text(encoding="utf-8").splitlines()
    ]
    by_conversation: dict[str, list[Completion]] = {}
    for c in steps:
        assert c.step is not None and c.turn_index is not None and c.request_key.endswith(f":step-{c.step}")
        by_conversation.setdefault(c.prompt_id, []).append(c)
    for convo in by_conversation.values():
        convo.sort(key=lambda c: c.step or 0)
        assert [c.step for c in convo] == list(range(len(convo)))
        assert [c.turn_index for c in convo] == sorted(c.turn_index or 0 for c in convo)
        assert all(
            (c.bridge_ids is None) == (i == 0 or c.turn_index != convo[i - 1].turn_index) for i, c in enumerate(convo)
        )
        # Each step was conditioned on the regenerated history: exactly the assistant turns generated before it.
        assert [sum(m.role == "assistant" for m in c.messages) for c in convo] == list(range(len(convo)))

    # One published line per conversation, each with a named outcome; a conversation with no line has reject rows.
    assert len({line["id"] for line in lines}) == len(lines)
    outcomes = Counter(line.get("outcome") for line in lines)
    assert set(outcomes) - {None} <= OUTCOMES | {o for o in outcomes if o and o.startswith("rejected_")}
    rejected_ids = {r["prompt_id"] for r in rejects}
    assert all(line["id"] in rejected_ids for line in lines if "outcome" not in line)
    assert {line["id"] for line in lines} | rejected_ids >= set(by_conversation)
    assert outcomes["complete"] > 0 and len(set(outcomes) & (OUTCOMES - {"complete"})) > 0, outcomes

    # Every row is the template's rendering of its published conversation cut at its turn; loss on generated spans.
    chat = ChatTokenizer.from_model_dir(model_dir)
    rows_of: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        rows_of.setdefault(r["conversation_id"], []).append(r)
    assert set(rows_of) == {line["id"] for line in lines}
    for line in lines:
        check_published_rows(chat, line, sorted(rows_of[line["id"]], key=lambda r: r["turn_index"]))
    # The run covered what it is for: a row with several user turns, one whose turn spans a spliced tool result.
    assert max(r["turn_index"] for r in rows) >= 2
    assert any(r["num_loss_spans"] >= 2 for r in rows)
    assert any(m["role"] == "tool" for line in lines for m in line["conversations"])

    # The manifest, the card and the flow's summary count conversations and turns.
    manifest = json.loads((local / "manifest.json").read_text())
    counts = manifest["lineage"]["conversations"]
    assert counts["published"] == len(lines) and counts["published_user_turns"] == len(rows)
    assert counts["conversations_planned"] == 26 == counts["conversations_finished"]
    assert counts["steps"] == len(steps) and counts["user_turns"] == sum(c.bridge_ids is None for c in steps)
    assert sum(counts["conversations_by_outcome"].values()) == 26
    card = yaml.safe_load((local / "README.md").read_text().split("---\n")[1])
    assert card["datagen"]["sizes"]["num_conversations"] == len(lines)
    assert card["datagen"]["sizes"]["num_turns"] == len(rows)
    assert summary["conversations"]["conversations_finished"] == 26 and summary["rows"] == len(rows)
    assert f"rows ({len(rejects)} rejects) from 26 of 26 conversations ({len(steps)} steps)" in summary_text(summary)


def test_every_turn_pilot_measures_conversations_and_the_main_run_reuses_their_steps(
    prefect_api: None, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pilot samples conversations and measures them per step and turn; the main run with `pilot:` imports each
    sampled conversation's step lines whole (not generated again) and continues none of them."""
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0.5")
    spec = _spec("turns_pilot_v1")
    result = pilot_flow(spec, PilotSpec(name="pt", sample_size=8, min_per_source=3, seed=7))
    convs = result["conversations"]
    assert convs["conversations"] == convs["finished"] == 8 == sum(convs["outcomes"].values())
    assert convs["steps"] > convs["conversations"] and convs["user_turns"] > convs["conversations"]
    assert result["projection"]["steps"] > 26
    # Step lengths per kind (tool rounds among them: the stand-in calls), and the wall simulated on chains.
    assert result["step_model"]["by_kind"]["first_turn"]["n"] == 8
    assert sum(k["n"] for k in result["step_model"]["by_kind"].values()) == convs["steps"]
    assert result["projection"]["policy"] == "expected_work_left"
    work = Path(pipeline_env["DATAGEN_WORK_DIR"])
    pilot_root = RunLayout.for_run(work, "pt").root
    assert "## Per turn" in (pilot_root / PILOT_MARKDOWN).read_text()

    report = expand_dataset(spec.model_copy(update={"pilot": "pt"}))
    assert report["prompts"] == 26 and report["conversations"]["conversations_finished"] == 26
    main = RunLayout.for_run(work, "turns_pilot_v1")
    pilot_steps = _lines(sorted(pilot_root.joinpath("shards").glob("*.completions.jsonl")))
    main_steps = _lines(sorted(main.shards_dir.glob("*.completions.jsonl")))
    assert len(pilot_steps) == convs["steps"] and pilot_steps <= main_steps
    # Every conversation's steps 0, 1, 2, ... exactly once: the pilot's were not continued or generated again.
    keys = Counter(json.loads(line)["request_key"] for line in main_steps)
    assert set(keys.values()) == {1}
    assert report["conversations"]["steps"] == len(main_steps)


def _conversation(*users: str) -> dict[str, Any]:
    messages: list[dict[str, str]] = []
    for i, user in enumerate(users):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": f"Recorded answer {i}."}]
    return {"messages": messages}


def test_every_turn_at_temperature_0_keeps_conversations_that_open_the_same_way(
    prefect_api: None, pipeline_env: dict[str, str], local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Issue 35.4: a deterministic server answers a shared opening identically, duplicate_completion cut the second
    # conversation at turn 0 and its distinct later turns were lost as earlier_turn_rejected, while the lineage still
    # counted it complete.
    monkeypatch.setenv("DATAGEN_STANDIN_LENGTH_MAX", "300")  # no truncation: every turn ends by itself
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0")
    source = tmp_path / "openings.jsonl"
    opening, second = "Plan a three-day trip to Lisbon.", "Now make it cheaper."
    conversations = [
        _conversation(opening, second, "Add a day trip to Sintra."),
        _conversation(opening, "Make it a family trip with two kids.", "Which museums suit them?"),  # shares turn 0
        _conversation(opening, second, "Swap the hotel for a hostel."),  # shares turns 0 and 1
        _conversation(opening, second, "Add a day trip to Sintra.", "And a fado evening?"),  # shares 0, 1, 2
        _conversation("Explain how tides work.", "And why there are two a day?"),
    ]
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations), encoding="utf-8")
    spec = RunSpec(
        sources=[PromptSource(path=str(source))],
        model_path=str(ensure_model_dir()),
        namespace="openings_v1",
        turns="every",
        shard_size=8,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024, temperature=0.0),
        quality_gate=QualityGate(min_median_completion_tokens=8, max_category_share=1.0, max_source_share=1.0),
    )
    summary = expand_dataset(spec)

    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    local = _published(store, "openings_v1", Path(pipeline_env["DATAGEN_WORK_DIR"]) / "dl")
    rows = pq.read_table(sorted((local / "data").glob("*.parquet"))).to_pylist()
    rejects = [r for f in sorted((local / "rejects").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    lines = [
        json.loads(line)
        for f in sorted((local / "conversations").glob("conversations-*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]
    assert rejects == []
    # Every user turn of every conversation, exactly once: the rows' (conversation, turn) pairs and their users.
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == len(lines) == len(conversations)
    published_users = sorted(
        tuple(m["content"] for m in line["conversations"] if m["role"] == "user") for line in lines
    )
    assert published_users == sorted(tuple(m["content"] for m in c["messages"][::2]) for c in conversations)
    turns = Counter((r["conversation_id"], r["turn_index"]) for r in rows)
    assert set(turns.values()) == {1}
    assert sorted(turns) == sorted((i, t) for i, line in by_id.items() for t in range(len(line["conversations"]) // 2))
    # The shared openings were answered identically (what a temperature-0 server does), and kept in each.
    answers = Counter(line["conversations"][1]["content"] for line in lines)
    assert answers.most_common(1)[0][1] == 4
    # The lineage counts what was published.
    manifest = json.loads((local / "manifest.json").read_text())
    counts = manifest["lineage"]["conversations"]
    assert counts["published"] == len(lines) and counts["published_user_turns"] == len(rows) == 15
    assert counts["conversations_by_outcome"] == {"complete": len(conversations)}
    assert summary["rows"] == 15
