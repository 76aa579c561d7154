"""Tool-calling conversations (the bundled OpenAI and ShareGPT files) through the whole `expand-dataset` flow:
stand-in server processes that sometimes answer with a tool call, the real local S3 server. None is rejected for
its tools, every token row's prompt is the model's template rendering `tools=`, and the calls are recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.chat import ChatTokenizer
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Completion, Prompt
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.sources.prompts import iter_prompts
from flows.expand_dataset import expand_dataset

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OPENAI = REPO / "data/prompts/tool_calls_openai.jsonl"
SHAREGPT = REPO / "data/prompts/tool_calls_sharegpt.jsonl"


def _openai_judge(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The row as the template takes it, read here without the loader: trailing reply dropped, arguments as objects."""
    messages = [dict(m) for m in row["messages"]]
    if messages[-1]["role"] == "assistant":
        messages.pop()
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
    return messages, row.get("tools")


def test_tool_conversations_run_end_to_end_with_tools_rendered(
    prefect_api: None, pipeline_env: dict[str, str], local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0.5")
    model_dir = ensure_model_dir()
    sources = [PromptSource(path=str(p), category_field="category") for p in (OPENAI, SHAREGPT)]
    spec = RunSpec(
        sources=sources,
        model_path=str(model_dir),
        namespace="tools_v1",
        turns="last",
        shard_size=8,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=8),
    )
    expand_dataset(spec)

    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
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
