"""Pytest fixtures for tests that run whole flows in-process: an embedded Prefect API and the DATAGEN_* env."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_CLIENT_MAX_RETRIES,
    PREFECT_SERVER_API_AUTH_STRING,
    temporary_settings,
)
from prefect.testing.utilities import prefect_test_harness

from datagen.local.localstack import LocalS3

__all__ = ["pipeline_env", "pipeline_env_vars", "prefect_api"]


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    """A temporary Prefect API (SQLite, basic auth on) for the module's flow runs; its client retries longer."""
    auth = f"datagen:{secrets.token_urlsafe(30)}"
    updates = {PREFECT_CLIENT_MAX_RETRIES: 7, PREFECT_SERVER_API_AUTH_STRING: auth, PREFECT_API_AUTH_STRING: auth}
    with temporary_settings(updates=updates), prefect_test_harness(server_startup_timeout=120):
        yield


def pipeline_env_vars(local_s3: LocalS3, tmp_path: Path) -> dict[str, str]:
    """The DATAGEN_* env of `pipeline_env`, for fixtures of a wider scope that set it themselves."""
    return {
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


@pytest.fixture
def pipeline_env(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3, tmp_path: Path) -> dict[str, str]:
    """Settings for a flow run on the session's S3 server under a fresh prefix, with two fast stand-in servers."""
    env = pipeline_env_vars(local_s3, tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
