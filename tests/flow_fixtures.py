"""Pytest fixtures for tests that run whole flows in-process: an embedded Prefect API and the DATAGEN_* env."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from datagen.localstack import LocalS3

__all__ = ["pipeline_env", "prefect_api"]


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    """A temporary Prefect API (SQLite) for the module's flow runs; the client retries a busy server longer."""
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 7}), prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def pipeline_env(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3, tmp_path: Path) -> dict[str, str]:
    """Settings for a flow run on the session's S3 server under a fresh prefix, with two fast stand-in servers."""
    env = {
        **local_s3.env(),
        "DATAGEN_S3_PREFIX": f"flow-{tmp_path.name}/",
        "DATAGEN_ENGINE": "standin",
        "DATAGEN_NUM_SERVERS": "2",
        "DATAGEN_BASE_PORT": "0",
        "DATAGEN_SKIP_GPU_CHECKS": "true",
        "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
        "DATAGEN_WORK_DIR": str(tmp_path / "work"),
        "DATAGEN_SERVER_START_TIMEOUT_S": "120",
        "DATAGEN_STANDIN_LENGTH_MEAN": "120",
        "DATAGEN_STANDIN_LENGTH_MAX": "400",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
