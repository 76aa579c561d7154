"""ObjectStore against a real SeaweedFS server: auth, reachability, create-only writes, preflight."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from datagen.local.localstack import LocalS3
from datagen.publishing.storage import (
    PREFLIGHT_DIR,
    BucketMissing,
    ObjectExists,
    ObjectStore,
    StorageAuthError,
    StorageUnreachable,
    s3_preflight,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_wrong_secret_is_an_auth_error_without_the_secret(local_s3: LocalS3) -> None:
    wrong = "not-the-secret-" + "x" * 20
    store = ObjectStore.from_settings(local_s3.settings(s3_secret_access_key=SecretStr(wrong)))
    with pytest.raises(StorageAuthError) as info:
        store.check_bucket()
    message = str(info.value)
    assert f"credentials were refused by {local_s3.endpoint_url}" in message
    assert wrong not in message and wrong not in repr(store)
    with pytest.raises(StorageAuthError):
        store.put_if_absent("never.txt", b"x")
    assert ObjectStore.from_settings(local_s3.settings()).head("never.txt") is None


def test_unknown_access_key_is_an_auth_error(local_s3: LocalS3) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_access_key_id=SecretStr("nobody")))
    with pytest.raises(StorageAuthError, match="credentials were refused"):
        list(store.list(""))


def test_unreachable_endpoint_names_it() -> None:
    endpoint = f"http://127.0.0.1:{_free_port()}"
    store = ObjectStore(
        bucket="datagen",
        endpoint_url=endpoint,
        access_key_id=SecretStr("k"),
        secret_access_key=SecretStr("s"),
        max_attempts=1,
    )
    with pytest.raises(StorageUnreachable, match=endpoint):
        store.check_bucket()
    with pytest.raises(StorageUnreachable, match=endpoint):
        store.put_if_absent("x", b"x")


def test_missing_bucket(local_s3: LocalS3) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_bucket="no-such-bucket-here"))
    with pytest.raises(BucketMissing, match="no-such-bucket-here"):
        store.check_bucket()
    with pytest.raises(BucketMissing):
        store.put_if_absent("x", b"x")


def test_put_if_absent_never_replaces(s3_store: ObjectStore) -> None:
    first = s3_store.put_if_absent("a/obj.bin", b"original bytes", metadata={"origin": "test"})
    assert first.sha256 == hashlib.sha256(b"original bytes").hexdigest()
    with pytest.raises(ObjectExists) as info:
        s3_store.put_if_absent("a/obj.bin", b"replacement")
    assert info.value.key == "a/obj.bin"
    assert info.value.existing_sha256 == first.sha256
    assert s3_store.get_bytes("a/obj.bin") == b"original bytes"
    head = s3_store.head("a/obj.bin")
    assert head is not None
    assert head.sha256 == first.sha256 and head.metadata["origin"] == "test" and head.size == 14


def test_conditional_multipart_is_refused_on_existing_key(local_s3: LocalS3, tmp_path: Path) -> None:
    store = ObjectStore.from_settings(
        local_s3.settings(s3_prefix="mp-" + os.urandom(4).hex()),
        multipart_threshold=5 * 1024 * 1024,
        multipart_chunksize=5 * 1024 * 1024,
    )
    original = tmp_path / "original.bin"
    original.write_bytes(os.urandom(11 * 1024 * 1024))
    rival = tmp_path / "rival.bin"
    rival.write_bytes(os.urandom(11 * 1024 * 1024))
    store.put_if_absent("big.bin", original)
    head = store.head("big.bin")
    assert head is not None and "-" in head.etag  # really went up in parts
    with pytest.raises(ObjectExists) as info:
        store.put_if_absent("big.bin", rival)
    assert info.value.existing_sha256 == hashlib.sha256(original.read_bytes()).hexdigest()
    assert store.get_bytes("big.bin") == original.read_bytes()


def test_list_paginates_and_exists(s3_store: ObjectStore) -> None:
    keys = [f"many/k{i:03d}" for i in range(23)]
    for key in keys:
        s3_store.put_if_absent(key, key.encode())
    s3_store.put_if_absent("other/x", b"x")
    assert [o.key for o in s3_store.list("many/", page_size=5)] == keys
    assert s3_store.exists("many/") and s3_store.exists("other/")
    assert not s3_store.exists("none/")


def test_preflight_passes_on_a_fresh_namespace_and_leaves_nothing(s3_store: ObjectStore) -> None:
    results = s3_preflight(s3_store, "fresh", resume=False)
    assert [(r.name, r.status) for r in results] == [
        ("s3.credentials", "pass"),
        ("s3.bucket", "pass"),
        ("s3.namespace_free", "pass"),
        ("s3.namespace_writable", "pass"),
    ]
    assert not s3_store.exists("fresh/")


def test_preflight_never_writes_inside_a_namespace(s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # `datagen check` runs this for a namespace nobody may have chosen yet (e.g. before `auto` is resolved):
    # its write probe must land beside the namespaces, not in one.
    written: list[str] = []
    put = s3_store.put_if_absent

    def recording_put(key: str, *args: Any, **kwargs: Any) -> Any:
        written.append(key)
        return put(key, *args, **kwargs)

    monkeypatch.setattr(s3_store, "put_if_absent", recording_put)
    results = {r.name: r for r in s3_preflight(s3_store, "fresh2", resume=False)}
    assert results["s3.namespace_writable"].status == "pass"
    assert len(written) == 1 and written[0].startswith(PREFLIGHT_DIR), written
    assert not s3_store.exists("fresh2/") and not s3_store.exists(PREFLIGHT_DIR)


def test_children_lists_one_level(s3_store: ObjectStore) -> None:
    for key in ("kids/a/x", "kids/a/y/z", "kids/b/x", "kids/top.txt"):
        s3_store.put_if_absent(key, b"1")
    assert s3_store.children("kids/") == ["a", "b"]
    assert s3_store.children("nothing-here/") == []


def test_preflight_fails_on_a_namespace_with_data(s3_store: ObjectStore) -> None:
    s3_store.put_if_absent("used/data/part-00000.parquet", b"existing")
    status = {r.name: r for r in s3_preflight(s3_store, "used", resume=False)}
    assert status["s3.namespace_free"].failed
    assert "already holds data" in status["s3.namespace_free"].detail
    resumed = {r.name: r.status for r in s3_preflight(s3_store, "used", resume=True)}
    assert resumed["s3.namespace_free"] == "pass"
    s3_store.put_if_absent("used/manifest.json", b"{}")
    published = {r.name: r for r in s3_preflight(s3_store, "used", resume=True)}
    assert published["s3.namespace_free"].failed
    assert "is published" in published["s3.namespace_free"].detail
    assert s3_store.get_bytes("used/data/part-00000.parquet") == b"existing"


def test_preflight_reports_bad_credentials_and_skips_the_rest(local_s3: LocalS3) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_secret_access_key=SecretStr("wrong")))
    results = s3_preflight(store, "ns", resume=False)
    assert [(r.name, r.status) for r in results] == [
        ("s3.credentials", "fail"),
        ("s3.bucket", "skipped"),
        ("s3.namespace_free", "skipped"),
        ("s3.namespace_writable", "skipped"),
    ]


def test_preflight_reports_a_missing_bucket(local_s3: LocalS3) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_bucket="missing-bucket"))
    status = {r.name: r.status for r in s3_preflight(store, "ns", resume=False)}
    assert status["s3.credentials"] == "pass"
    assert status["s3.bucket"] == "fail"
