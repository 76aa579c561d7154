"""A dataset published by the real flow (stand-in servers, local S3), downloaded: what the conversation tests read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from flows.expand_dataset import expand_dataset
from tests.flow_fixtures import pipeline_env_vars

__all__ = ["PublishedRun", "published_run"]

# Single and multi-turn rows, with and without a system prompt, in OpenAI and ShareGPT form.
CONVERSATION_ROWS: list[dict[str, Any]] = [
    *({"messages": [{"role": "user", "content": f"Explain topic number {i} in two paragraphs."}]} for i in range(4)),
    *(
        {
            "conversations": [
                {"from": "system", "value": "You are a careful math tutor."},
                {"from": "human", "value": f"What is {i} times {i + 3}? Show the steps."},
            ]
        }
        for i in range(3)
    ),
    {
        "messages": [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And a larger one?"},
        ]
    },
]


@dataclass(frozen=True)
class PublishedRun:
    """One published namespace: its objects downloaded under `local`, and what made it."""

    spec: RunSpec
    store: ObjectStore
    local: Path  # the namespace's objects, keyed by their path relative to the namespace
    work_dir: Path
    model_dir: Path


@pytest.fixture(scope="module")
def published_run(
    prefect_api: None, local_s3: LocalS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PublishedRun]:
    """Run `expand-dataset` once for the module and download what it published."""
    tmp = tmp_path_factory.mktemp("conversations")
    prompts = tmp / "chats.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATION_ROWS), encoding="utf-8")
    model_dir = ensure_model_dir()
    env = pipeline_env_vars(local_s3, tmp)
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))],
        model_path=str(model_dir),
        namespace="conv_v1",
        turns="last",
        shard_size=3,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        expand_dataset(spec)
        store = ObjectStore.from_settings(local_s3.settings(s3_prefix=env["DATAGEN_S3_PREFIX"]))
        local = tmp / "download"
        for obj in store.list(f"{spec.namespace}/"):
            target = local / obj.key[len(spec.namespace) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(store.get_bytes(obj.key))
        yield PublishedRun(
            spec=spec, store=store, local=local, work_dir=Path(env["DATAGEN_WORK_DIR"]), model_dir=model_dir
        )
