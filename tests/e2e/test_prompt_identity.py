"""One prompt, one generation, for the life of a dataset (issue 47), against real S3 and an attached stand-in.

A directory source (`turns: every`, the default) is published, then, one nightly expansion after another: its file
renamed, split into two, a new file that sorts first and shares prompts with it, rows inserted at the top of a file,
and every recorded reply edited. The stand-in is attached by URL, so its own request counter says what each
expansion sent: nothing for what was published; only the new conversations' steps otherwise. Nothing is published
twice (a conversation, a prompt id, a load reject), and no old reject is published again.

The test reads only what every version of the pipeline has (the flow, S3, the stand-in's counter), so it runs
unchanged on the code before issue 47, where it fails at the rename: every prompt was sent again.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from datagen.engine.endpoints import ServerEndpoint
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from flows.expand_dataset import expand_dataset

pytestmark = pytest.mark.slow


def conversation(i: int, reply: str = "A recorded reply.") -> dict[str, Any]:
    """Row i: even rows are two user turns with a recorded reply between (which every turn discards), odd rows one."""
    if i % 2:
        return {"id": f"row-{i}", "messages": [{"role": "user", "content": f"Question {i}: why is the sky blue?"}]}
    return {
        "id": f"row-{i}",
        "messages": [
            {"role": "user", "content": f"Trip {i}: plan three days in Lisbon."},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Trip {i}: now make it cheaper."},
        ],
    }


BROKEN = ['{"messages": [{"role": "user", "content": "unterminated', json.dumps({"id": "empty", "messages": []})]


def write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def rows(*ids: int, reply: str = "A recorded reply.") -> list[str]:
    return [json.dumps(conversation(i, reply)) for i in ids]


def requests_served(endpoint: ServerEndpoint) -> int:
    """The stand-in's own count of the requests it processed (its /metrics, as SGLang reports it)."""
    text = httpx.get(f"{endpoint.url}/metrics", timeout=10).text
    return sum(
        int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("sglang:num_requests_total{")
    )


def published(store: ObjectStore) -> dict[str, dict[str, Any]]:
    """What each published namespace holds, read back from S3: its conversations (by their user turns), the prompt
    ids of its rows and rejects, its load rejects and its manifest."""
    out: dict[str, dict[str, Any]] = {}
    for o in store.list(""):
        if not o.key.endswith("/manifest.json") or o.key.startswith("_"):
            continue
        ns = o.key.split("/", 1)[0]
        users: list[tuple[str, ...]] = []
        ids: set[str] = set()
        load: list[dict[str, Any]] = []
        for obj in store.list(f"{ns}/"):
            body = store.get_bytes(obj.key)
            if obj.key.startswith(f"{ns}/conversations/"):
                for line in body.decode().splitlines():
                    turns = json.loads(line)["conversations"]
                    users.append(tuple(m["content"] for m in turns if m["role"] == "user"))
            elif obj.key.endswith(".parquet") and "/data/" in obj.key:
                ids |= set(pq.read_table(io.BytesIO(body), columns=["prompt_id"]).column("prompt_id").to_pylist())
            elif obj.key.endswith(".parquet") and "/rejects/" in obj.key:
                for r in pq.read_table(io.BytesIO(body)).to_pylist():
                    if r["stage"] == "load":
                        load.append(r)
                    elif r["prompt_id"] is not None:
                        ids.add(r["prompt_id"])
        manifest = json.loads(store.get_bytes(o.key))
        out[ns] = {"users": users, "ids": ids, "load": load, "manifest": manifest}
    return out


def user_turns(*ids: int) -> set[tuple[str, ...]]:
    return {tuple(m["content"] for m in conversation(i)["messages"] if m["role"] == "user") for i in ids}


def test_renames_splits_new_files_inserted_rows_and_edited_replies_generate_nothing_published(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0")
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    src = tmp_path / "src"
    src.mkdir()
    spec = RunSpec(
        sources=[PromptSource(path=str(src))],  # a directory: each file is its own source, labelled by its name
        model_path=str(ensure_model_dir()),
        namespace="auto",
        shard_size=4,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(
            max_reject_rate=0.5, min_median_completion_tokens=8, max_source_share=1.0, max_category_share=1.0
        ),
    )
    assert spec.turns == "every"  # the default

    with run_standin(ensure_model_dir(), args=["--enable-metrics"]) as endpoint:
        assert endpoint.api_key is not None
        monkeypatch.setenv("DATAGEN_SERVER_URLS", json.dumps([endpoint.url]))
        monkeypatch.setenv("DATAGEN_SGLANG_API_KEY", endpoint.api_key.get_secret_value())

        def expand() -> tuple[dict[str, Any], int]:
            before = requests_served(endpoint)
            summary = expand_dataset(spec)
            return summary, requests_served(endpoint) - before

        def nothing_new(summary: dict[str, Any], sent: int, skipped: int) -> None:
            assert sent == 0, f"{sent} requests sent for prompts published before"
            assert summary["uri"] is None and summary["prompts"] == 0, summary
            assert summary["skipped_published"] == skipped and summary["old_rejects_skipped"] == 2, summary

        # Night 0: the source, 8 conversations and 2 broken rows.
        write(src / "S.jsonl", [*rows(0, 1), BROKEN[0], *rows(2, 3, 4, 5), BROKEN[1], *rows(6, 7)])
        first, sent = expand()
        assert first["namespace"] == "expansion_v1" and first["prompts"] == 8
        v1 = published(store)["expansion_v1"]
        assert set(v1["users"]) == user_turns(*range(8)) and len(v1["load"]) == 2
        assert sent == v1["manifest"]["lineage"]["conversations"]["steps"] > 8

        # Night 1: the file renamed. Night 2: split into two files.
        (src / "S.jsonl").rename(src / "S2.jsonl")
        nothing_new(*expand(), skipped=8)
        lines = (src / "S2.jsonl").read_text().splitlines()
        write(src / "S2a.jsonl", lines[:5])
        write(src / "S2b.jsonl", lines[5:])
        (src / "S2.jsonl").unlink()
        nothing_new(*expand(), skipped=8)

        # Night 3: a new file that sorts first, with 3 of the published prompts and 2 new ones: only those 2 are sent,
        # and the old file's copies of the 3 are neither generated again nor new duplicate_prompt rejects.
        write(src / "0new.jsonl", rows(1, 100, 2, 4, 101))
        third, sent = expand()
        assert third["namespace"] == "expansion_v2" and third["prompts"] == 2, third
        assert third["skipped_published"] == 3 + 8 and third["old_rejects_skipped"] == 2, third
        v2 = published(store)["expansion_v2"]
        assert set(v2["users"]) == user_turns(100, 101) and v2["load"] == []
        assert sent == v2["manifest"]["lineage"]["conversations"]["steps"]

        # Night 4: rows inserted at the top of a file, a new prompt and a new broken row among them: only they are new.
        write(
            src / "S2a.jsonl", [*rows(102), '{"messages": "not a list"}', *(src / "S2a.jsonl").read_text().splitlines()]
        )
        fourth, sent = expand()
        assert fourth["namespace"] == "expansion_v3" and fourth["prompts"] == 1, fourth
        assert fourth["skipped_published"] == 5 + 8 and fourth["old_rejects_skipped"] == 2, fourth
        v3 = published(store)["expansion_v3"]
        assert set(v3["users"]) == user_turns(102) and [r["reason"] for r in v3["load"]] == ["wrong_type"]
        assert sent == v3["manifest"]["lineage"]["conversations"]["steps"]

        # Night 5: every recorded reply edited (every turn never sends them): nothing new.
        for path in sorted(src.glob("*.jsonl")):
            edited = [
                line.replace("A recorded reply.", "Another recorded reply, longer.")
                for line in path.read_text().splitlines()
            ]
            write(path, edited)
        assert "Another recorded reply" in (src / "S2a.jsonl").read_text()
        fifth, sent = expand()
        assert sent == 0 and fifth["prompts"] == 0 and fifth["uri"] is None, fifth
        assert fifth["skipped_published"] == 6 + 8 and fifth["old_rejects_skipped"] == 3, fifth

    # Nothing published twice: each conversation, each prompt id, each broken row in exactly one namespace.
    everything = published(store)
    assert sorted(everything) == ["expansion_v1", "expansion_v2", "expansion_v3"]
    conversations = Counter(u for ns in everything.values() for u in ns["users"])
    assert set(conversations) == user_turns(*range(8), 100, 101, 102) and set(conversations.values()) == {1}
    ids = Counter(i for ns in everything.values() for i in ns["ids"])
    assert len(ids) == 11 and set(ids.values()) == {1}
    assert sum(len(ns["load"]) for ns in everything.values()) == 3


def test_a_namespace_name_under_another_prefix_gets_its_own_work_dir(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # Issue 47.8: a run into the same namespace name under another DATAGEN_S3_PREFIX took the first one's work dir:
    # its checkpoints (nothing generated) and its first attempt's run id, name and date (in the manifest and card).
    monkeypatch.setenv("DATAGEN_STANDIN_TOOL_CALL_RATE", "0")
    source = tmp_path / "prompts.jsonl"
    write(source, rows(1, 3, 5))
    spec = RunSpec(
        sources=[PromptSource(path=str(source))],
        model_path=str(ensure_model_dir()),
        namespace="twin",
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(min_median_completion_tokens=8, max_source_share=1.0, max_category_share=1.0),
    )
    prefixes = [pipeline_env["DATAGEN_S3_PREFIX"] + "one/", pipeline_env["DATAGEN_S3_PREFIX"] + "two/"]
    with run_standin(ensure_model_dir(), args=["--enable-metrics"]) as endpoint:
        assert endpoint.api_key is not None
        monkeypatch.setenv("DATAGEN_SERVER_URLS", json.dumps([endpoint.url]))
        monkeypatch.setenv("DATAGEN_SGLANG_API_KEY", endpoint.api_key.get_secret_value())
        manifests, sent = [], []
        for prefix in prefixes:
            monkeypatch.setenv("DATAGEN_S3_PREFIX", prefix)
            before = requests_served(endpoint)
            summary = expand_dataset(spec)
            sent.append(requests_served(endpoint) - before)
            assert summary.get("already_published") is None and summary["rows"] == 3, summary
            store = ObjectStore.from_settings(local_s3.settings(s3_prefix=prefix))
            manifests.append(json.loads(store.get_bytes("twin/manifest.json")))
    # Each prefix's run generated its conversations and names itself: no checkpoint or first attempt shared.
    assert sent == [3, 3]
    one, two = (m["lineage"] for m in manifests)
    assert one["run_id"] != two["run_id"] and one["run_name"] != two["run_name"]
    runs = Path(pipeline_env["DATAGEN_WORK_DIR"]) / "runs"
    assert sorted(p.name.split("@")[0] for p in runs.iterdir()) == ["twin", "twin"]
