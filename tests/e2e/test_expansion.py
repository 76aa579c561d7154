"""Scheduled expansion against the real local S3 and stand-in servers: new prompts only, new namespace, old intact."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing import catalog
from datagen.publishing.storage import ObjectStore
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from flows.expand_dataset import expand_dataset
from tasks.publishing import PublishError, publish, refuse_other_run

pytestmark = pytest.mark.slow


def _write(path: Path, label: str, n: int, start: int = 0) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for i in range(start, start + n):
            row = {"messages": [{"role": "user", "content": f"[{label}] Explain idea {i} briefly."}], "category": label}
            f.write(json.dumps(row) + "\n")


def _spec(sources: list[Path], **extra: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "sources": [PromptSource(path=str(p), category_field="category") for p in sources],
            "model_path": str(ensure_model_dir()),
            "namespace": "auto",
            "shard_size": 6,
            "context_length": 8192,
            "sampling": SamplingSpec(max_new_tokens=1024),
            "quality_gate": QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
            **extra,
        }
    )


def _snapshot(store: ObjectStore, prefix: str) -> dict[str, str]:
    return {o.key: hashlib.sha256(store.get_bytes(o.key)).hexdigest() for o in store.list(prefix)}


def _published_ids(store: ObjectStore, namespace: str) -> set[str]:
    ids: set[str] = set()
    for kind in ("data/", "rejects/"):
        for o in store.list(f"{namespace}/{kind}"):
            table = pq.read_table(io.BytesIO(store.get_bytes(o.key)), columns=["prompt_id"])
            ids |= {p for p in table.column("prompt_id").to_pylist() if p is not None}
    return ids


def _write_broken(path: Path, tag: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "user", "content": "unterminated ' + tag + '"\n')  # invalid JSON
        f.write(json.dumps({"messages": [], "category": "chat", "tag": tag}) + "\n")  # no messages


def _load_rejects(store: ObjectStore) -> list[str]:
    """The location of every load reject any namespace published (one entry per published row)."""
    found: list[str] = []
    for o in store.list(""):
        if "/rejects/" in o.key and o.key.endswith(".parquet"):
            rows = pq.read_table(io.BytesIO(store.get_bytes(o.key))).to_pylist()
            found += [str(r["location"]) for r in rows if r["stage"] == "load"]
    return found


def _at_load(summary: dict[str, object]) -> int:
    reasons = summary["rejects_by_reason"]
    assert isinstance(reasons, dict)
    return sum(n for reason, n in reasons.items() if reason.startswith("load/"))


def test_scheduled_expansions_over_a_growing_source_with_broken_rows(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 35.1-3: skipped rows were not counted, so the source's permanent rejects became the whole load gate
    # (nothing new -> "all rows read were rejected"), every expansion published them again, and the log named
    # the catalog's size as the rows skipped. Every run here uses the default reject limit (20%).
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    chat_file, code_file = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
    _write(chat_file, "chat", 10)
    _write_broken(chat_file, "first")

    first = expand_dataset(_spec([chat_file], quality_gate=QualityGate(min_median_completion_tokens=16)))
    assert first["namespace"] == "expansion_v1" and first["uri"] == store.uri("expansion_v1/")
    v1_ids = _published_ids(store, "expansion_v1")
    assert len(v1_ids) == 10 and _at_load(first) == 2
    assert catalog.catalog_namespaces(store) == ["expansion_v1"]
    assert catalog.published_prompt_ids(store) == v1_ids
    assert len(catalog.published_load_rejects(store)) == 2
    before = _snapshot(store, "expansion_v1/")

    def spec(**extra: object) -> RunSpec:
        sources = [chat_file, code_file] if code_file.exists() else [chat_file]
        return _spec(sources, quality_gate=QualityGate(min_median_completion_tokens=16), **extra)

    # Nothing new: green, nothing published, the old rejects skipped and said so.
    second = expand_dataset(spec())
    assert second["prompts"] == 0 and second["uri"] is None
    assert second["skipped_published"] == 10 and second["old_rejects_skipped"] == 2
    assert "old rejects skipped" in second["message"]
    assert not store.exists(f"{second['namespace']}/")

    # 5 new rows: exactly they are published, the old rejects are not published again. Another set in the catalog
    # (not in these sources): the planning log counts the rows this run skipped, not the catalog's size.
    _publish_rows(store, tmp_path, "other-set", ["x1", "x2", "x3"], {"x4": "truncated"})
    _write(chat_file, "chat", 5, start=10)
    caplog.clear()
    third = expand_dataset(spec())
    assert "skipped as published before: 10 prompts and 2 old rejects" in caplog.text
    assert third["namespace"] == "expansion_v2" and third["prompts"] == 5
    assert third["skipped_published"] == 10 and third["old_rejects_skipped"] == 2
    v2_ids = _published_ids(store, "expansion_v2")
    assert len(v2_ids) == 5 and not v1_ids & v2_ids
    card = store.get_bytes("expansion_v2/README.md").decode()
    assert "skipped as published by earlier namespaces: 10 prompts and 2" in card

    # 5 more rows, 2 new broken ones and a new source capped at 5 of its 12 prompts: 2/(5+2+5+15) at load.
    _write(chat_file, "chat", 5, start=15)
    _write_broken(chat_file, "fourth")
    _write(code_file, "code", 12)
    fourth = expand_dataset(spec(source_targets={"code": 5}))
    assert fourth["namespace"] == "expansion_v3" and fourth["prompts"] == 10 and _at_load(fourth) == 2
    assert fourth["skipped_published"] == 15 and fourth["old_rejects_skipped"] == 2
    v3_ids = _published_ids(store, "expansion_v3")
    assert len(v3_ids) == 10 and not (v1_ids | v2_ids) & v3_ids
    part = pq.read_table(io.BytesIO(store.get_bytes(catalog.part_key("expansion_v3"))))
    assert sorted(part.column("source").to_pylist()).count("code") == 5
    manifest = json.loads(store.get_bytes("expansion_v3/manifest.json"))
    assert manifest["lineage"]["run_spec"]["namespace"] == "expansion_v3"
    assert manifest["lineage"]["old_rejects_skipped"] == 2

    # Issue 35.6: another run spec into a published namespace is refused, naming that run (it ended green, as
    # "published by an earlier attempt of this run", when the work dir held that run's staged files).
    v3 = _snapshot(store, "expansion_v3/")
    with pytest.raises(Exception, match=r"'expansion_v3' was published by another run \(run expand .*source_targets"):
        expand_dataset(spec(source_targets={"code": 6}, namespace="expansion_v3"))
    assert _snapshot(store, "expansion_v3/") == v3

    # Every broken row is in exactly one published rejects object; the first namespace is untouched.
    rejects = _load_rejects(store)
    assert len(rejects) == len(set(rejects)) == 4
    assert _snapshot(store, "expansion_v1/") == before


def test_catalog_backfills_a_namespace_published_without_its_part(s3_store: ObjectStore, tmp_path: Path) -> None:
    # A namespace published the way a crash right after its manifest leaves it: data, manifest, no catalog part.
    staging = tmp_path / "dataset"
    (staging / "data").mkdir(parents=True)
    (staging / "rejects").mkdir()
    pq.write_table(
        pa.table({"prompt_id": ["a1", "b2"], "source": ["chat", "code"], "category": ["x", None]}),
        staging / "data" / "train-00000-of-00001.parquet",
    )
    pq.write_table(
        pa.table({"prompt_id": ["c3", None], "source": ["chat", "chat"], "stage": ["validate", "load"]}),
        staging / "rejects" / "rejects-00000-of-00001.parquet",
    )
    publish(staging, "expansion_v1", s3_store, {})
    before = _snapshot(s3_store, "expansion_v1/")
    assert catalog.catalog_namespaces(s3_store) == []

    # Naming the next namespace only reads; repair (run before every plan) writes the missing part.
    assert catalog.next_expansion_namespace(s3_store) == "expansion_v2"
    assert catalog.catalog_namespaces(s3_store) == []
    assert catalog.repair(s3_store) == ["expansion_v1"]
    part = pq.read_table(io.BytesIO(s3_store.get_bytes(catalog.part_key("expansion_v1")))).to_pylist()
    assert part == [
        {"prompt_id": "a1", "source": "chat", "category": "x", "status": "data", "reason": None},
        {"prompt_id": "b2", "source": "code", "category": None, "status": "data", "reason": None},
        {"prompt_id": "c3", "source": "chat", "category": None, "status": "rejected", "reason": None},
    ]
    assert catalog.published_prompt_ids(s3_store) == {"a1", "b2", "c3"}
    assert catalog.published_prompt_ids(s3_store, exclude={"expansion_v1"}) == set()
    assert catalog.backfill(s3_store, "expansion_v1") is False  # already catalogued: nothing written again
    # Writing the part again from the same files is accepted; from different files it is refused, not replaced.
    assert catalog.write_part(s3_store, "expansion_v1", staging) == 3
    (staging / "data" / "train-00000-of-00001.parquet").unlink()
    with pytest.raises(catalog.CatalogError, match="not replaced"):
        catalog.write_part(s3_store, "expansion_v1", staging)
    assert _snapshot(s3_store, "expansion_v1/") == before


def _publish_rows(store: ObjectStore, tmp_path: Path, namespace: str, data: list[str], rejects: dict[str, str]) -> None:
    staging = tmp_path / namespace
    (staging / "data").mkdir(parents=True)
    (staging / "rejects").mkdir()
    pq.write_table(
        pa.table({"prompt_id": data, "source": ["chat"] * len(data)}), staging / "data" / "train-00000-of-00001.parquet"
    )
    pq.write_table(
        pa.table(
            {
                "prompt_id": list(rejects),
                "source": ["chat"] * len(rejects),
                "stage": ["validate"] * len(rejects),
                "reason": list(rejects.values()),
            }
        ),
        staging / "rejects" / "rejects-00000-of-00001.parquet",
    )
    publish(staging, namespace, store, {})
    catalog.write_part(store, namespace, staging)


def test_an_expansion_retries_the_reject_reasons_it_names(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Issue 23.5: every rejected prompt counted as published, so no later expansion ever retried it.
    _publish_rows(
        s3_store, tmp_path, "expansion_v1", ["a1"], {"t1": "truncated", "t2": "truncated", "p1": "placeholder"}
    )
    _publish_rows(s3_store, tmp_path, "expansion_v2", ["t2"], {"t3": "truncated"})  # t2 retried once and published
    assert catalog.published_prompt_ids(s3_store) == {"a1", "t1", "t2", "p1", "t3"}  # the default: none retried
    assert catalog.published_prompt_ids(s3_store, retry=["truncated"]) == {"a1", "t2", "p1"}
    assert catalog.published_prompt_ids(s3_store, retry=["truncated", "placeholder"]) == {"a1", "t2"}
    assert catalog.published_prompt_ids(s3_store, exclude={"expansion_v2"}, retry=["truncated"]) == {"a1", "p1"}


def test_retry_rejected_names_only_reasons_a_published_reject_can_carry() -> None:
    from datagen.checks.quality import VALIDATION_REASONS
    from datagen.runspec import RETRYABLE_REASONS
    from tasks.tokenization import TOKENIZE_REASONS

    assert set(VALIDATION_REASONS) | set(TOKENIZE_REASONS) <= RETRYABLE_REASONS
    assert RunSpec(retry_rejected=["truncated", "truncated", "placeholder"]).retry_rejected == [
        "placeholder",
        "truncated",
    ]
    assert RunSpec().retry_rejected == []
    with pytest.raises(ValueError, match="'invalid_json' not a reason a published reject can carry"):
        RunSpec(retry_rejected=["invalid_json"])
    assert "Default: none" in (RunSpec.model_fields["retry_rejected"].description or "")


def test_a_namespace_is_refused_only_to_another_run_spec(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Issue 35.6, and a dataset published before a run spec field existed still resumes (only shared keys compared).
    staging = tmp_path / "dataset"
    (staging / "data").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["a1"], "source": ["chat"]}), staging / "data" / "train.parquet")
    ours = RunSpec(sources=[PromptSource(path="chat.jsonl")], namespace="older").model_dump(mode="json")
    older = {k: v for k, v in ours.items() if k != "retry_rejected"}  # a field added after it was published
    older["sources"] = [{k: v for k, v in ours["sources"][0].items() if k != "tools"}]
    publish(staging, "older", s3_store, {"run_spec": older, "run_name": "expand older · calm-otter"})
    refuse_other_run(s3_store, "older", ours)  # the same run: no error
    other = {**ours, "sources": [{**ours["sources"][0], "path": "code.jsonl"}]}
    with pytest.raises(
        PublishError, match=r"published by another run \(run expand older · calm-otter.*\(sources differ\)"
    ):
        refuse_other_run(s3_store, "older", other)
    refuse_other_run(s3_store, "never-published", other)
