"""The whole `expand-dataset` flow against stand-in server processes and the real local S3 server."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from datasets import load_dataset
from prefect import flow
from pydantic import SecretStr

from datagen.chat import ChatTokenizer
from datagen.identity import PromptIdentity
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Message
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from flows.expand_dataset import expand_dataset, publish_task

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
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mixed.jsonl"
    lines = [json.dumps(r) for r in GOOD_ROWS[:12]] + [MALFORMED_LINES[0]] + [json.dumps(r) for r in GOOD_ROWS[12:]]
    lines.insert(20, MALFORMED_LINES[1])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _spec(prompt_file: Path, model_dir: Path, namespace: str) -> RunSpec:
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


def test_flow_publishes_token_exact_dataset_and_never_overwrites(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    prompt_file: Path,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stand-ins emulate one RTX PRO 6000 each with Qwen3.6-27B's weights: the run's memory plan applies.
    monkeypatch.setenv("DATAGEN_STANDIN_GPU_MEMORY_BYTES", str(97_887 * 2**20))
    spec = _spec(prompt_file, model_dir, "e2e_v1")
    report = expand_dataset(spec)

    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
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

    # The same run again (its work dir holds what it published) finds its own manifest and is done; another run
    # (here: another work dir) is refused with a clear error. Every object stays byte-identical.
    before = _snapshot(store, "e2e_v1/")
    again = expand_dataset(spec)
    assert again["already_published"] is True and again["uri"] == store.uri("e2e_v1/")
    assert _snapshot(store, "e2e_v1/") == before
    monkeypatch.setenv("DATAGEN_WORK_DIR", str(tmp_path / "another-box"))
    with pytest.raises(Exception, match=r"e2e_v1.*(already|holds|published)"):
        expand_dataset(spec)
    assert _snapshot(store, "e2e_v1/") == before


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
