"""The whole `expand-dataset` flow against stand-in server processes and the real local S3 server, in both turn modes.

Each run publishes once for the module: the bundled multi-turn, tool-calling prompt files (OpenAI and ShareGPT
forms) in each mode (`published_tools`: `tools_v1` in `last`, `turns_v1` in `every`), against stand-ins that
sometimes answer with a tool call, and a mixed prompt file in `last` (`published_last`). In both modes the bundled
files load whole and every conversation is settled; a published run run again is done, and another run is refused
(`published`). Each run is then judged from what it published, as its mode makes it:

- `last`, mixed file (malformed rows among them): a token-exact dataset, each row's prompt the template's render of
  its messages, the completion what the server returned.
- `last`, bundled files: every token row's prompt is the model's template rendering `tools=`, and the calls are
  recorded.
- `every`, bundled files: the conversations are regenerated turn by turn. Every token row is the real template's
  `apply_chat_template(..., tools=...)` of the published conversation cut at its user turn, loss on exactly the
  assistant turns the model wrote; every conversation ends with a named outcome or a reject row; the manifest, the
  card and the flow's summary count conversations and turns. The every-turn pilot and a temperature-0 run are of
  that mode alone.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from datasets import load_dataset
from prefect import flow
from pydantic import SecretStr

from datagen.chat import ChatTokenizer
from datagen.conversation.turn_mode import turn_mode
from datagen.identity import PromptIdentity
from datagen.layout import RunLayout
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Completion, Message, Prompt
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.sources.prompts import iter_prompts
from flows.cli import summary_text
from flows.expand_dataset import expand_dataset, publish_task
from flows.pilot import pilot_flow
from tasks.pilot import PILOT_MARKDOWN, PilotSpec
from tests.flow_fixtures import pipeline_env_vars
from tests.turn_fixtures import check_published_rows

pytestmark = pytest.mark.slow

GOOD_ROWS: list[dict[str, Any]] = [
    *(
        {
            "messages": [{"role": "user", "content": f"Explain topic number {i} in two paragraphs."}],
            "category": "explain",
        }
        for i in range(10)
    ),
    *(
        {
            "conversations": [
                {"from": "system", "value": "You are a careful math tutor."},
                {"from": "human", "value": f"What is {i} times {i + 3}? Show the steps."},
                {"from": "gpt", "value": "OK."},  # trailing assistant turn: dropped, regenerated
            ],
            "category": "math",
        }
        for i in range(8)
    ),
    *(
        {"instruction": f"Write a haiku about the number {i}.", "input": "", "output": "", "category": "writing"}
        for i in range(6)
    ),
    {
        "messages": [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And a larger one?"},
        ],
        "category": "math",
    },
]
MALFORMED_LINES = ['{"messages": [{"role": "user", "content": "unterminated', '{"conversations": "not a list"}']


def _expected_messages(row: dict[str, Any]) -> list[Message]:
    if "messages" in row:
        return [Message.from_dict(m) for m in row["messages"]]
    if "conversations" in row:
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        msgs = [Message.from_dict({"role": roles[t["from"]], "content": t["value"]}) for t in row["conversations"]]
        return msgs[:-1] if msgs[-1].role == "assistant" else msgs
    return [Message(role="user", content=row["instruction"])]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mixed.jsonl"
    lines = [json.dumps(r) for r in GOOD_ROWS[:12]] + [MALFORMED_LINES[0]] + [json.dumps(r) for r in GOOD_ROWS[12:]]
    lines.insert(20, MALFORMED_LINES[1])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _last_spec(prompt_file: Path, model_dir: Path, namespace: str) -> RunSpec:
    return RunSpec(
        sources=[PromptSource(path=str(prompt_file), category_field="category")],
        model_path=str(model_dir),
        namespace=namespace,
        turns="last",
        shard_size=7,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
    )


def _snapshot(store: ObjectStore, prefix: str) -> dict[str, str]:
    return {o.key: hashlib.sha256(store.get_bytes(o.key)).hexdigest() for o in store.list(prefix)}


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

OPENAI, SHAREGPT = SOURCES


def _openai_judge(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The row as the template takes it, read here without the loader: trailing reply dropped, arguments as objects."""
    messages = [dict(m) for m in row["messages"]]
    if messages[-1]["role"] == "assistant":
        messages.pop()
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
    return messages, row.get("tools")


def _published(store: ObjectStore, namespace: str, local: Path) -> Path:
    """Download the published namespace to `local`."""
    for o in store.list(f"{namespace}/"):
        dest = local / o.key.removeprefix(f"{namespace}/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(store.get_bytes(o.key))
    return local


def _every_spec(namespace: str) -> RunSpec:
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


def _tools_last_spec(namespace: str) -> RunSpec:
    return _every_spec(namespace).model_copy(update={"turns": "last"})


def _lines(paths: list[Path]) -> set[bytes]:
    return {line for p in paths for line in p.read_bytes().splitlines() if line.strip()}


@dataclass(frozen=True)
class Published:
    """A mode's run, published: its spec, the flow's report, the DATAGEN_* env it ran with, its store."""

    spec: RunSpec
    report: dict[str, Any]
    env: dict[str, str]
    store: ObjectStore

    @property
    def work(self) -> Path:
        return Path(self.env["DATAGEN_WORK_DIR"])


def _publish(spec: RunSpec, env: dict[str, str], local_s3: LocalS3) -> Published:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        report = expand_dataset(spec)
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=env["DATAGEN_S3_PREFIX"]))
    return Published(spec, report, env, store)


@pytest.fixture(scope="module")
def published_last(
    prefect_api: None,
    local_s3: LocalS3,
    tmp_path_factory: pytest.TempPathFactory,
    prompt_file: Path,
    model_dir: Path,
) -> Published:
    """The mixed prompt file, `turns: last`, on stand-ins that emulate one RTX PRO 6000 each with Qwen3.6-27B's
    weights (the run's memory plan applies)."""
    env = pipeline_env_vars(local_s3, tmp_path_factory.mktemp("flow-last"))
    env["DATAGEN_STANDIN_GPU_MEMORY_BYTES"] = str(97_887 * 2**20)
    return _publish(_last_spec(prompt_file, model_dir, "e2e_v1"), env, local_s3)


@pytest.fixture(scope="module")
def published_every(prefect_api: None, local_s3: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """The bundled tool-calling sets, `turns: every`, on stand-ins that answer with a tool call half the time."""
    env = pipeline_env_vars(local_s3, tmp_path_factory.mktemp("flow-every"))
    env["DATAGEN_STANDIN_TOOL_CALL_RATE"] = "0.5"
    return _publish(_every_spec("turns_v1"), env, local_s3)


@pytest.fixture(scope="module")
def published_tools_last(prefect_api: None, local_s3: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """The bundled tool-calling sets, `turns: last`, on stand-ins that answer with a tool call half the time."""
    env = pipeline_env_vars(local_s3, tmp_path_factory.mktemp("flow-tools-last"))
    env["DATAGEN_STANDIN_TOOL_CALL_RATE"] = "0.5"
    return _publish(_tools_last_spec("tools_v1"), env, local_s3)


@pytest.fixture(params=["last", "every"])
def published_tools(request: pytest.FixtureRequest) -> Published:
    """The bundled tool-calling sets published in each mode."""
    run: Published = request.getfixturevalue("published_tools_last" if request.param == "last" else "published_every")
    return run


@pytest.fixture(params=["last", "every"])
def published(request: pytest.FixtureRequest) -> Published:
    """Each mode's published run."""
    run: Published = request.getfixturevalue(f"published_{request.param}")
    return run


def test_flow_publishes_token_exact_dataset(
    published_last: Published, prompt_file: Path, model_dir: Path, tmp_path: Path
) -> None:
    spec, store, report = published_last.spec, published_last.store, published_last.report
    assert report["uri"] == store.uri("e2e_v1/")
    keys = {o.key for o in store.list("e2e_v1/")}
    assert "e2e_v1/manifest.json" in keys and "e2e_v1/README.md" in keys
    md = store.get_bytes("e2e_v1/validation-report.md").decode()  # each reason's share and examples
    assert "**PASSED**: quality gate" in md and "| reason | count | share of completions | examples |" in md
    manifest = json.loads(store.get_bytes("e2e_v1/manifest.json"))
    memory = manifest["lineage"]["memory_plan"]
    assert "--disable-radix-cache" in memory["plan_args"] and memory["numerics_flags"] == []
    assert memory["running_requests_per_gpu"] > memory["default_running_requests_per_gpu"]
    # Sized for the prompts as planning rendered them, not an assumed 512 tokens.
    assert "measured at planning from the rendered prompts" in memory["context_source"]
    assert memory["context_tokens"] < 512 + 512  # short test prompts + max_new_tokens/2
    card = store.get_bytes("e2e_v1/README.md").decode()
    assert f"memory plan flags (no effect on outputs): {' '.join(memory['plan_args'])}" in card
    listed = [o["key"] for o in manifest["objects"]]
    assert len(listed) == len(set(listed)) == len(keys) - 1  # every object but the manifest, exactly once

    local = tmp_path / "download"
    for key in keys:
        target = local / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get_bytes(key))
    data = load_dataset("parquet", data_files=sorted(str(p) for p in (local / "e2e_v1/data").glob("*.parquet")))[
        "train"
    ]
    rejects = load_dataset("parquet", data_files=sorted(str(p) for p in (local / "e2e_v1/rejects").glob("*.parquet")))[
        "train"
    ]

    # Malformed rows: reported with file, line and reason; the good rows still ran.
    load_rejects = [r for r in rejects if r["stage"] == "load"]
    assert sorted(r["row"] for r in load_rejects) == [12, 20]
    assert all("mixed.jsonl" in r["detail"] for r in load_rejects)
    assert sorted(r["location"] for r in load_rejects) == [f"{prompt_file}:13", f"{prompt_file}:21"]

    source = "mixed"
    identity = PromptIdentity.for_spec(spec)  # ids follow the rendered tokens
    expected = {identity.prompt_id(source, _expected_messages(r)): _expected_messages(r) for r in GOOD_ROWS}
    shipped = [r["prompt_id"] for r in data]
    rejected_later = [r["prompt_id"] for r in rejects if r["stage"] != "load"]
    assert len(shipped) == len(set(shipped))  # one row per accepted prompt
    assert set(shipped) | set(rejected_later) == set(expected)  # nothing lost
    assert not set(shipped) & set(rejected_later)
    assert len(shipped) >= len(expected) // 2

    chat = ChatTokenizer.from_model_dir(model_dir)
    for row in data:
        n_prompt = row["prompt_tokens"]
        prompt_text = chat.render(expected[row["prompt_id"]], enable_thinking=True)
        assert chat.decode(row["input_ids"][:n_prompt]) == prompt_text
        completion = chat.decode(row["input_ids"][n_prompt:])
        assert "</think>" in completion and completion.endswith("<|im_end|>")
        assert row["loss_mask"] == [0] * n_prompt + [1] * row["completion_tokens"]
        assert len(row["input_ids"]) == n_prompt + row["completion_tokens"]


def test_the_bundled_tool_calling_sets_load_whole_and_every_conversation_settles(published_tools: Published) -> None:
    """Both modes: no row of either file is refused for its tools or tool turns, and each of the 26 conversations
    has checkpoint lines (a step, or its reject) keyed as its mode keys them."""
    spec, store, work = published_tools.spec, published_tools.store, published_tools.work
    mode = turn_mode(spec)
    local = _published(store, spec.namespace, work / "dl-both")
    rejects = pq.read_table(sorted((local / "rejects").glob("*.parquet"))).to_pylist()
    assert [r for r in rejects if r["stage"] == "load" or r["reason"] in TOOL_REASONS] == []
    shards = RunLayout.for_run(work, spec.namespace).shards_dir
    lines = [
        json.loads(line)
        for f in sorted([*shards.glob("*.completions.jsonl"), *shards.glob("*.rejects.jsonl")])
        for line in f.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert lines and all(mode.split_key(line["request_key"]) is not None for line in lines)
    assert len({line["prompt_id"] for line in lines}) == 26


def test_tool_conversations_run_end_to_end_with_tools_rendered(
    published_tools_last: Published, model_dir: Path
) -> None:
    spec, store, pipeline_env = published_tools_last.spec, published_tools_last.store, published_tools_last.env
    sources = spec.sources
    rows: list[dict[str, Any]] = []
    reject_rows: list[dict[str, Any]] = []
    for o in store.list("tools_v1/"):
        if o.key.endswith(".parquet"):
            local = Path(pipeline_env["DATAGEN_WORK_DIR"]) / "dl" / o.key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(store.get_bytes(o.key))
            (rows if "/data/" in o.key else reject_rows).extend(pq.read_table(local).to_pylist())
    assert [r for r in reject_rows if r["stage"] == "load"] == []  # none rejected for tools or tool turns

    chat = ChatTokenizer.from_model_dir(model_dir)
    loaded = [p for p in iter_prompts(sources) if isinstance(p, Prompt)]
    by_location = {p.location: p for p in loaded}
    expected: dict[str, str] = {}  # rendered prompt text by the location of its row
    for lineno, line in enumerate(OPENAI.read_text().splitlines(), 1):
        messages, tools = _openai_judge(json.loads(line))
        kw = {"tools": tools} if tools else {}
        expected[f"{OPENAI}:{lineno}"] = chat._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=True, **kw
        )
    for lineno in range(1, len(SHAREGPT.read_text().splitlines()) + 1):
        p = by_location[f"{SHAREGPT}:{lineno}"]
        kw = {"tools": p.tools} if p.tools else {}
        expected[f"{SHAREGPT}:{lineno}"] = chat._hf.apply_chat_template(
            [m.to_dict() for m in p.messages], tokenize=False, add_generation_prompt=True, enable_thinking=True, **kw
        )

    # Every prompt is shipped or rejected after generation, never lost; the shipped ones are the template's render.
    completions = [
        Completion.from_json(line)
        for f in (Path(pipeline_env["DATAGEN_WORK_DIR"]) / "runs" / "tools_v1" / "shards").glob("*.completions.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(completions) == len(loaded) == 26
    by_id = {c.prompt_id: c for c in completions}
    assert len(rows) >= 20
    for row in rows:
        c = by_id[row["prompt_id"]]
        n = row["prompt_tokens"]
        assert chat.decode(row["input_ids"][:n]) == expected[c.location]
        assert row["loss_mask"] == [0] * n + [1] * row["completion_tokens"]
    with_tools = [c for c in completions if c.tools]
    assert len(with_tools) == 22 and all("<tools>" in expected[c.location] for c in with_tools)
    # The stand-in called the first declared function in some answers: each is recorded as parsed calls.
    called = [c for c in with_tools if "<tool_call>" in c.text.rsplit("</think>", 1)[-1]]
    assert called and all(c.tool_calls and c.tool_calls[0].name == c.tools[0]["function"]["name"] for c in called)
    assert all(c.tool_calls is None for c in completions if c not in called)


def test_every_turn_run_publishes_rows_equal_to_the_template_of_its_conversations(
    published_every: Published, model_dir: Path
) -> None:
    summary, store, work = published_every.report, published_every.store, published_every.work
    mode = turn_mode(published_every.spec)
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
        split = mode.split_key(c.request_key)
        assert c.step is not None and c.turn_index is not None and split is not None and split[1] == c.step
        assert c.request_key == mode.step_key(split[0], c.step)
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


def _read_back(store: ObjectStore, namespace: str, local: Path) -> tuple[list[Any], list[Any], list[Any]]:
    """What a reader of the namespace finds: its token rows, reject rows and conversation lines."""
    local = _published(store, namespace, local)
    rows = [r for f in sorted((local / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    rejects = [r for f in sorted((local / "rejects").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    lines = [
        json.loads(line)
        for f in sorted((local / "conversations").glob("conversations-*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]
    return rows, rejects, lines


def _copies(rows: list[dict[str, Any]]) -> int:
    """Rows identical (ids and mask) to an earlier row."""
    seen: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter(
        (tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in rows
    )
    return sum(n - 1 for n in seen.values())


def test_every_count_equals_a_read_back_of_s3(published_tools: Published) -> None:
    """Issue 47.6/7: the manifest said 0 rows, and the lineage, report and inspect counted generation's outcomes
    where validation had cut conversations. Both modes: every count is what a reader of S3 finds."""
    from datagen.operations.inspection import inspect_namespace

    spec, store, work, summary = (
        published_tools.spec,
        published_tools.store,
        published_tools.work,
        published_tools.report,
    )
    ns = spec.namespace
    rows, rejects, lines = _read_back(store, ns, work / "dl-counts")
    manifest = json.loads(store.get_bytes(f"{ns}/manifest.json"))
    assert manifest["total_rows"] == {"data": len(rows), "rejects": len(rejects), "conversations": len(lines)}
    for entry in manifest["objects"]:
        key = entry["key"]
        if key.endswith(".parquet"):
            assert entry["rows"] == pq.read_metadata(work / "dl-counts" / key).num_rows, key
        elif key.endswith(".jsonl"):
            assert entry["rows"] == len((work / "dl-counts" / key).read_text().splitlines()), key
    lineage = manifest["lineage"]
    assert lineage["rows"] == summary["rows"] == len(rows) and lineage["rejects"] == summary["rejects"] == len(rejects)
    assert lineage["duplicate_rows"] == summary["duplicate_rows"] == _copies(rows)
    card = yaml.safe_load((work / "dl-counts" / "README.md").read_text().split("---\n")[1])["datagen"]["sizes"]
    assert card["num_examples"] == len(rows) and card["num_rejects"] == len(rejects)
    assert card["num_duplicate_rows"] == _copies(rows)
    text, published = inspect_namespace(store, ns)
    assert published and f"{len(rows):,} rows, {len(rejects):,} rejects" in text, text
    if spec.turns == "every":
        assert card["num_conversations"] == len(lines) and card["num_turns"] == len(rows)
        counts = lineage["conversations"]
        by_outcome = counts["conversations_by_outcome"]
        assert summary["conversations"]["conversations_by_outcome"] == by_outcome
        # Each published line's outcome is counted under it (complete: every user turn is a row).
        published_outcomes = Counter(line["outcome"] for line in lines if "outcome" in line)
        for outcome, n in published_outcomes.items():
            assert by_outcome.get(outcome, 0) >= n, (outcome, by_outcome, published_outcomes)
        assert by_outcome.get("complete", 0) == published_outcomes["complete"]
        assert sum(by_outcome.values()) == counts["conversations_finished"] == 26
        assert f"complete {by_outcome['complete']:,}" in text and f"published: {len(lines):,} conversations" in text


def test_every_user_turn_of_the_source_is_in_a_row_or_a_reject(published_every: Published) -> None:
    """Issue 47.7: the user turns after a conversation ended early (a diverging call, a cut) were in no row and no
    reject. Every user turn of every conversation of the sources is now a row or names itself in a reject."""
    from datagen.conversation.regeneration import Script

    spec, store, work = published_every.spec, published_every.store, published_every.work
    rows, rejects, _ = _read_back(store, spec.namespace, work / "dl-turns")
    identity = PromptIdentity.for_spec(spec)
    turns = {
        p.prompt_id: len(Script.of(p).turns)
        for p in iter_prompts(spec.sources, identity=identity)
        if isinstance(p, Prompt)
    }
    assert len(turns) == 26 and sum(turns.values()) > 26
    covered: dict[str, list[int]] = {pid: [] for pid in turns}
    refused: Counter[str] = Counter()
    for r in rows:
        covered[r["conversation_id"]].append(r["turn_index"])
    for r in rejects:
        found = re.search(r", turn (\d+)", r["detail"])
        if found:
            covered[r["prompt_id"]].append(int(found.group(1)))
        elif r["stage"] == "generate":
            refused[r["prompt_id"]] += 1  # names its step: it stands for the turn that step was for
    for pid, n in turns.items():
        missing = set(range(n)) - set(covered[pid])
        assert len(missing) <= refused[pid], (pid, n, covered[pid], refused[pid])
    unreached = [r for r in rejects if "not generated: the conversation ended at turn" in r["detail"]]
    assert unreached, "the stand-in's calls diverge half the time: some conversations end before their last turn"


def test_published_rows_and_conversations_trace_back_to_their_source_row(published_tools: Published) -> None:
    """Issue 47.9: the source row's own id was dropped, and rows and conversations carried no file and line."""
    spec, store, work = published_tools.spec, published_tools.store, published_tools.work
    rows, rejects, lines = _read_back(store, spec.namespace, work / "dl-trace")

    def source_row(location: str) -> dict[str, Any]:
        path, line = location.rsplit(":", 1)
        return json.loads(Path(path).read_text(encoding="utf-8").splitlines()[int(line) - 1])

    assert rows and lines
    for item in [*rows, *lines, *(r for r in rejects if r["stage"] != "load")]:
        assert item["location"] is not None and item["source_id"] == source_row(item["location"])["id"], item[
            "location"
        ]
    ids = {line["id"]: line["source_id"] for line in lines}
    assert all(ids[r["conversation_id"]] == r["source_id"] for r in rows)


def test_regenerated_tool_calls_carry_ids_their_results_answer(published_every: Published) -> None:
    """Issue 47.10: published tool results kept the recorded tool_call_id, the regenerated calls had no id."""
    _, _, lines = _read_back(published_every.store, published_every.spec.namespace, published_every.work / "dl-ids")
    results = 0
    for line in lines:
        calls: list[str] = []
        for m in line["conversations"]:
            if m["role"] == "assistant":
                calls = [c["id"] for c in m.get("tool_calls") or []]
                assert all(calls) and len(set(calls)) == len(calls), m
            elif m["role"] == "tool":
                results += 1
                assert m.get("tool_call_id") in calls, (line["id"], m, calls)
        every = [c["id"] for m in line["conversations"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        assert len(set(every)) == len(every), line["id"]  # unique in their conversation
    assert results > 0


def test_a_published_run_run_again_is_done_and_another_run_is_refused(
    published: Published, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, store = published.spec, published.store
    namespace = spec.namespace
    for k, v in published.env.items():
        monkeypatch.setenv(k, v)
    # The same run again (its work dir holds what it published) finds its own manifest and is done; another run
    # (here: another work dir) is refused with a clear error. Every object stays byte-identical.
    before = _snapshot(store, f"{namespace}/")
    again = expand_dataset(spec)
    assert again["already_published"] is True and again["uri"] == store.uri(f"{namespace}/")
    assert _snapshot(store, f"{namespace}/") == before
    monkeypatch.setenv("DATAGEN_WORK_DIR", str(tmp_path / "another-box"))
    with pytest.raises(Exception, match=rf"{namespace}.*(already|holds|published)"):
        expand_dataset(spec)
    assert _snapshot(store, f"{namespace}/") == before


def test_every_turn_pilot_measures_conversations_and_the_main_run_reuses_their_steps(
    prefect_api: None, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pilot samples conversations and measures them per step and turn; the main run with `pilot:` imports each
    sampled conversation's step lines whole (not generated again) and continues none of them."""
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0.5")
    spec = _every_spec("turns_pilot_v1")
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
    # Issue 47.5: the shared turns' rows are byte-identical copies, kept in each conversation and counted everywhere:
    # turn 0 of 4 conversations, turn 1 of 3, turn 2 of 2.
    assert _copies(rows) == 3 + 2 + 1 == manifest["lineage"]["duplicate_rows"] == summary["duplicate_rows"]
    assert manifest["lineage"]["duplicate_row_groups"] == 3
    card = yaml.safe_load((local / "README.md").read_text().split("---\n")[1])["datagen"]["sizes"]
    assert (
        card["num_duplicate_rows"] == 6
        and "identical rows: 6 rows repeat an earlier row" in (local / "README.md").read_text()
    )


def test_publish_task_reports_wrong_secret_and_unreachable_endpoint(
    prefect_api: None, local_s3: LocalS3, tmp_path: Path
) -> None:
    staging = tmp_path / "dataset"
    (staging / "data").mkdir(parents=True)
    (staging / "data" / "train-00000-of-00001.parquet").write_bytes(b"not really parquet, but bytes to upload")

    @flow
    def only_publish(store: ObjectStore) -> Any:
        return publish_task(staging, "creds_test", store, {})

    wrong = ObjectStore.from_settings(local_s3.settings(s3_secret_access_key=SecretStr("wrong-secret")))
    state = only_publish(wrong, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"(?i)credential|signature|access denied|refused"):
        state.result()

    unreachable = ObjectStore.from_settings(local_s3.settings(s3_endpoint_url="http://127.0.0.1:9"))
    state = only_publish(unreachable, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):
        state.result()
