"""Pytest fixtures: one real SeaweedFS S3 server per test session (credentials enforced), a fresh prefix per test."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from datagen.local.localstack import LocalS3
from datagen.publishing.storage import ObjectStore

__all__ = ["local_s3", "s3_store"]


@pytest.fixture(scope="session")
def local_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """A `weed mini` on free loopback ports for the whole session; stopped at the end, also after failures."""
    root: Path = tmp_path_factory.mktemp("s3")
    with LocalS3(root) as server:
        yield server


@pytest.fixture
def s3_store(local_s3: LocalS3) -> ObjectStore:
    """An ObjectStore on the session server under a prefix no other test uses (tests never see each other's keys)."""
    return ObjectStore.from_settings(local_s3.settings(s3_prefix=f"test-{secrets.token_hex(6)}"))
