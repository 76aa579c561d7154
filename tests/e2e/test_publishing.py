"""publish() against a real SeaweedFS server: layout, manifest last, refusals, races, resume after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from datagen.local.localstack import LocalS3
from datagen.publishing.storage import ObjectStore
from tasks.publishing import CLAIM_NAME, MANIFEST_NAME, PublishError, PublishResult, abandon, publish

LINEAGE: dict[str, Any] = {
    "run_spec": {"namespace": "ignored-here"},
    "model_fingerprint": "sha256:abc",
    "sglang_version": "0.5.10",
    "gpu_type": "NVIDIA RTX PRO 6000 Blackwell",
    "chat_template_sha256": "def",
    "pipeline_version": "0.1.0",
}


def make_staging(root: Path, shards: int = 3, size: int = 2048, seed: bytes = b"") -> Path:
    """A staging dir shaped like RunLayout.staging_dir: data/*.parquet, rejects/*.parquet, README.md."""
    (root / "data").mkdir(parents=True)
    (root / "rejects").mkdir()
    for i in range(shards):
        (root / "data" / f"part-{i:05d}.parquet").write_bytes(seed + os.urandom(size))
    (root / "rejects" / "part-00000.parquet").write_bytes(seed + os.urandom(size // 4))
    (root / "README.md").write_text("# test dataset\n")
    return root


def snapshot(store: ObjectStore, prefix: str) -> dict[str, bytes]:
    """Every object's bytes under prefix."""
    return {o.key: store.get_bytes(o.key) for o in store.list(prefix)}


def test_publish_layout_and_manifest(s3_store: ObjectStore, tmp_path: Path) -> None:
    staging = make_staging(tmp_path / "dataset")
    lineage = {**LINEAGE, "row_counts": {"data/part-00000.parquet": 10, "rejects/part-00000.parquet": 2}}
    result = publish(staging, "ds1", s3_store, lineage)

    staged = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    stored = snapshot(s3_store, "ds1/")
    assert sorted(stored) == sorted([f"ds1/{k}" for k in staged] + [f"ds1/{CLAIM_NAME}", f"ds1/{MANIFEST_NAME}"])
    for key in staged:
        assert stored[f"ds1/{key}"] == (staging / key).read_bytes()

    assert result.uri == s3_store.uri("ds1/")
    assert result.manifest_key == f"ds1/{MANIFEST_NAME}"
    assert result.written[-1] == result.manifest_key  # manifest last
    manifest = json.loads(stored[f"ds1/{MANIFEST_NAME}"])
    # Issue 25.5: the run's dataset link and `datagen inspect` (the manifest's total_bytes) give one size.
    assert result.objects == len(stored) and result.bytes == manifest["total_bytes"]
    assert result.bytes == sum(len(b) for k, b in stored.items() if k != f"ds1/{MANIFEST_NAME}")
    listed = [o["key"] for o in manifest["objects"]]
    assert sorted(listed) == sorted([*staged, CLAIM_NAME]) and len(listed) == len(set(listed))
    for entry in manifest["objects"]:
        body = stored[f"ds1/{entry['key']}"]
        assert entry["size"] == len(body) and entry["sha256"] == hashlib.sha256(body).hexdigest()
    rows = {o["key"]: o.get("rows") for o in manifest["objects"]}
    assert rows["data/part-00000.parquet"] == 10 and rows["data/part-00001.parquet"] is None
    assert manifest["total_rows"] == {"data": 10, "rejects": 2, "conversations": 0}
    assert manifest["lineage"]["sglang_version"] == "0.5.10"
    head = s3_store.head("ds1/data/part-00000.parquet")
    assert head is not None
    assert head.sha256 == hashlib.sha256((staging / "data/part-00000.parquet").read_bytes()).hexdigest()


def test_published_namespace_is_refused_and_untouched(s3_store: ObjectStore, tmp_path: Path) -> None:
    publish(make_staging(tmp_path / "a"), "done", s3_store, LINEAGE)
    before = snapshot(s3_store, "done/")
    with pytest.raises(PublishError) as info:
        publish(make_staging(tmp_path / "b"), "done", s3_store, LINEAGE)
    assert str(info.value) == (
        f"{s3_store.uri('done/manifest.json')} already exists: the dataset in namespace 'done' is published; "
        "choose a new namespace"
    )
    assert snapshot(s3_store, "done/") == before


def test_namespace_with_other_data_is_refused_and_untouched(s3_store: ObjectStore, tmp_path: Path) -> None:
    # Stand-ins for the owner's completions: same key as one of ours, and one key of its own.
    s3_store.put_if_absent("taken/data/part-00001.parquet", b"the owner's shard")
    s3_store.put_if_absent("taken/completions.jsonl", b"the owner's completions")
    before = snapshot(s3_store, "taken/")
    staging = make_staging(tmp_path / "dataset")
    with pytest.raises(PublishError, match="taken/") as info:
        publish(staging, "taken", s3_store, LINEAGE)
    assert "already exists" in str(info.value)
    assert snapshot(s3_store, "taken/") == before
    # Only the same-named shard: refused for its different content, naming that key.
    s3_store.put_if_absent("taken2/data/part-00001.parquet", b"the owner's shard")
    with pytest.raises(PublishError, match=r"taken2/data/part-00001\.parquet already exists with different content"):
        publish(staging, "taken2", s3_store, LINEAGE)
    assert snapshot(s3_store, "taken2/") == {"taken2/data/part-00001.parquet": b"the owner's shard"}


def test_dry_run_writes_nothing(s3_store: ObjectStore, tmp_path: Path) -> None:
    result = publish(make_staging(tmp_path / "dataset"), "dry", s3_store, LINEAGE, dry_run=True)
    assert result.dry_run and not result.written
    assert result.planned[0] == f"dry/{CLAIM_NAME}" and result.planned[-1] == f"dry/{MANIFEST_NAME}"
    assert len(result.planned) == 3 + 1 + 1 + 2
    assert not s3_store.exists("dry/")


def test_lineage_that_is_not_json_writes_nothing(s3_store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="not plain JSON"):
        publish(make_staging(tmp_path / "dataset"), "badlineage", s3_store, {"when": object()})
    assert not s3_store.exists("badlineage/")


def test_racing_publishers_exactly_one_wins(local_s3: LocalS3, s3_store: ObjectStore, tmp_path: Path) -> None:
    stores = [ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_store.prefix)) for _ in range(2)]
    stagings = [make_staging(tmp_path / f"p{i}", shards=4, seed=bytes([i])) for i in range(2)]
    barrier = threading.Barrier(2)
    outcomes: list[PublishResult | Exception] = [RuntimeError("not run")] * 2

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = publish(stagings[i], "race", stores[i], LINEAGE)
        except PublishError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    winners = [i for i, o in enumerate(outcomes) if isinstance(o, PublishResult)]
    losers = [o for o in outcomes if isinstance(o, PublishError)]
    assert len(winners) == 1 and len(losers) == 1
    winner = stagings[winners[0]]
    stored = snapshot(s3_store, "race/")
    for path in winner.rglob("*"):
        if path.is_file():
            assert stored[f"race/{path.relative_to(winner).as_posix()}"] == path.read_bytes()
    manifest = json.loads(stored[f"race/{MANIFEST_NAME}"])
    assert sorted(f"race/{o['key']}" for o in manifest["objects"]) == sorted(set(stored) - {f"race/{MANIFEST_NAME}"})


def test_upload_meeting_a_different_object_stops(local_s3: LocalS3, s3_store: ObjectStore, tmp_path: Path) -> None:
    rival = ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_store.prefix))
    real_put = s3_store.put_if_absent

    def put_after_rival(key: str, data: bytes | Path, sha256: str | None = None, metadata: Any = None) -> Any:
        if key == "late/data/part-00002.parquet":
            rival.put_if_absent(key, b"written by someone else in between")  # the real server then answers 412
        return real_put(key, data, sha256, metadata)

    s3_store.put_if_absent = put_after_rival  # type: ignore[method-assign]
    with pytest.raises(PublishError, match=r"late/data/part-00002\.parquet appeared during the upload"):
        publish(make_staging(tmp_path / "dataset"), "late", s3_store, LINEAGE, workers=1)
    assert s3_store.get_bytes("late/data/part-00002.parquet") == b"written by someone else in between"
    assert s3_store.head(f"late/{MANIFEST_NAME}") is None


def test_objects_of_the_same_files_are_skipped(s3_store: ObjectStore, tmp_path: Path) -> None:
    staging = make_staging(tmp_path / "dataset")
    # An earlier publish of the same files that stopped before the claim and manifest.
    for key in ("data/part-00000.parquet", "README.md"):
        s3_store.put_if_absent(f"part/{key}", staging / key)
    result = publish(staging, "part", s3_store, LINEAGE)
    assert result.skipped == ["part/README.md", "part/data/part-00000.parquet"]
    assert not set(result.written) & set(result.skipped)


_KILLED_PUBLISHER = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from datagen.settings import Settings
    from datagen.publishing.storage import ObjectStore
    from tasks.publishing import publish

    store = ObjectStore.from_settings(Settings())
    real_put = store.put_if_absent
    lock, done, marker = threading.Lock(), [], Path(sys.argv[2])

    def put(key, data, sha256=None, metadata=None):
        with lock:
            if len(done) >= 4:  # the claim and three shards are up: hang here until SIGKILL
                marker.write_text("\\n".join(done))
                threading.Event().wait()
        info = real_put(key, data, sha256, metadata)
        with lock:
            done.append(key)
        return info

    store.put_if_absent = put
    publish(Path(sys.argv[1]), "killed", store, {"pipeline_version": "test"}, workers=1)
    """
)


def test_publish_killed_halfway_resumes_without_reuploading(
    local_s3: LocalS3, s3_store: ObjectStore, tmp_path: Path
) -> None:
    staging = make_staging(tmp_path / "dataset", shards=8)
    script = tmp_path / "publisher.py"
    script.write_text(_KILLED_PUBLISHER)
    marker = tmp_path / "uploaded.txt"
    env = {**os.environ, **local_s3.env(), "DATAGEN_S3_PREFIX": s3_store.prefix}
    proc = subprocess.Popen([sys.executable, str(script), str(staging), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the publisher never got halfway"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    first_half = marker.read_text().split("\n")
    assert first_half[0] == f"killed/{CLAIM_NAME}" and len(first_half) == 4
    assert s3_store.head(f"killed/{MANIFEST_NAME}") is None  # a reader sees an incomplete dataset
    before = snapshot(s3_store, "killed/")

    uploads: list[str] = []
    real_put = s3_store.put_if_absent

    def counting_put(key: str, data: bytes | Path, sha256: str | None = None, metadata: Any = None) -> Any:
        uploads.append(key)
        return real_put(key, data, sha256, metadata)

    s3_store.put_if_absent = counting_put  # type: ignore[method-assign]
    result = publish(staging, "killed", s3_store, {"pipeline_version": "test"})
    assert not set(uploads) & set(first_half)  # nothing of the first half went up again
    assert sorted(result.skipped) == sorted(first_half)
    after = snapshot(s3_store, "killed/")
    assert {k: after[k] for k in before} == before
    manifest = json.loads(after[f"killed/{MANIFEST_NAME}"])
    listed = [f"killed/{o['key']}" for o in manifest["objects"]]
    assert len(listed) == len(set(listed)) == len(after) - 1
    assert set(listed) == set(after) - {f"killed/{MANIFEST_NAME}"}


def test_a_resumed_publish_writes_the_first_attempts_manifest(s3_store: ObjectStore, tmp_path: Path) -> None:
    staging = make_staging(tmp_path / "dataset")
    first_lineage = {**LINEAGE, "engine_version": "0.5.23"}
    # The first attempt wrote its claim and died; the re-run knows less (no server started: no engine version).
    claim_only = publish(staging, "pinned", s3_store, first_lineage, dry_run=True, created_at="2026-01-02T03:04:05Z")
    assert claim_only.planned[0] == f"pinned/{CLAIM_NAME}"
    uninterrupted = publish(staging, "twin", s3_store, first_lineage, created_at="2026-01-02T03:04:05Z")
    s3_store.put_if_absent(f"pinned/{CLAIM_NAME}", s3_store.get_bytes(f"twin/{CLAIM_NAME}"))
    result = publish(
        staging, "pinned", s3_store, {**LINEAGE, "engine_version": None}, created_at="2027-12-31T00:00:00Z"
    )
    assert result.skipped == [f"pinned/{CLAIM_NAME}"]
    manifest = json.loads(s3_store.get_bytes(f"pinned/{MANIFEST_NAME}"))
    assert manifest["created_at"] == "2026-01-02T03:04:05Z"
    assert manifest["lineage"]["engine_version"] == "0.5.23"
    twin = json.loads(s3_store.get_bytes(f"twin/{MANIFEST_NAME}"))
    assert {**manifest, "uri": "", "namespace": ""} == {**twin, "uri": "", "namespace": ""}
    assert uninterrupted.objects == result.objects

    # Killed after the manifest: the same publish again finds its own manifest and is done, writing nothing.
    before = snapshot(s3_store, "pinned/")
    again = publish(staging, "pinned", s3_store, LINEAGE)
    assert again.written == [] and f"pinned/{MANIFEST_NAME}" in again.skipped
    assert snapshot(s3_store, "pinned/") == before


def test_a_claim_of_other_files_names_the_command_that_unblocks_it(s3_store: ObjectStore, tmp_path: Path) -> None:
    first = make_staging(tmp_path / "first")
    publish(first, "stuck", s3_store, LINEAGE, dry_run=True)
    twin = publish(first, "stuck-twin", s3_store, LINEAGE)
    s3_store.put_if_absent(f"stuck/{CLAIM_NAME}", s3_store.get_bytes(f"stuck-twin/{CLAIM_NAME}"))
    s3_store.put_if_absent("stuck/data/part-00000.parquet", first / "data" / "part-00000.parquet")
    assert twin.written
    before = snapshot(s3_store, "stuck/")
    other = make_staging(tmp_path / "other")  # the work dir is gone: regenerated files differ
    with pytest.raises(PublishError) as info:
        publish(other, "stuck", s3_store, LINEAGE)
    message = str(info.value)
    assert "holds an unfinished publish of other files" in message
    assert "re-run the run that claimed it" in message and "`datagen abandon stuck`" in message
    assert snapshot(s3_store, "stuck/") == before

    marker = abandon(s3_store, "stuck", "work dir lost")
    assert marker == s3_store.uri("stuck/abandoned.json")
    after = snapshot(s3_store, "stuck/")
    assert {k: after[k] for k in before} == before and set(after) - set(before) == {"stuck/abandoned.json"}
    body = json.loads(after["stuck/abandoned.json"])
    assert body["reason"] == "work dir lost"
    assert sorted(o["key"] for o in body["objects_left"]) == ["data/part-00000.parquet", CLAIM_NAME]
    assert abandon(s3_store, "stuck", "again") == marker and snapshot(s3_store, "stuck/") == after
    # Nothing is published there afterwards, not even the files that claimed it.
    for staging in (first, other):
        with pytest.raises(PublishError, match="was abandoned"):
            publish(staging, "stuck", s3_store, LINEAGE)
    assert snapshot(s3_store, "stuck/") == after
    # A published namespace cannot be abandoned; an empty one has nothing to abandon.
    with pytest.raises(PublishError, match="is published; there is nothing to abandon"):
        abandon(s3_store, "stuck-twin", "no")
    with pytest.raises(PublishError, match="holds nothing"):
        abandon(s3_store, "never-used", "no")
