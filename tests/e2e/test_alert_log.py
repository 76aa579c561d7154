"""The laptop's alert listener (datagen.operations.alert_log) as its own process: only posts with its bearer
token are logged."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from datagen.operations import alert_log


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`python -m datagen.operations.alert_log serve` in a state dir; its URL and the dir."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "datagen.operations.alert_log", "serve", "--state-dir", str(tmp_path)]
    )
    try:
        port_file = tmp_path / "alert-log.port"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text()):
            assert proc.poll() is None, "the listener exited"
            assert time.monotonic() < deadline, "the listener wrote no port file in 60 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/", tmp_path
    finally:
        proc.terminate()
        proc.wait(30)


def test_listener_logs_only_posts_with_its_token(listener: tuple[str, Path]) -> None:
    url, state_dir = listener
    token_file = state_dir / "alert-log.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text()
    assert len(token) >= 32
    log = state_dir / alert_log.LOG_NAME
    body = {"subject": "s", "text": "expand run-1 ended Failed\n| failing task: generate"}

    refused = [
        httpx.post(url, json={**body, "text": "forged: no token"}),
        httpx.post(url, json={**body, "text": "forged: wrong token"}, headers={"Authorization": "Bearer nope"}),
        httpx.post(url, json={**body, "text": "forged: bare token"}, headers={"Authorization": token}),
    ]
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert not log.exists() or "forged" not in log.read_text()

    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 204
    bad = httpx.post(url, content=json.dumps({"no": "text"}), headers={"Authorization": f"Bearer {token}"})
    assert bad.status_code == 400
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" expand run-1 ended Failed | failing task: generate")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_the_alert_log_and_its_folder_are_private(tmp_path: Path) -> None:
    state = tmp_path / "laptop"
    state.mkdir(mode=0o755)
    old_log = state / alert_log.LOG_NAME
    old_log.write_text("an older version's line\n")
    old_log.chmod(0o644)
    proc = subprocess.Popen([sys.executable, "-m", "datagen.operations.alert_log", "serve", "--state-dir", str(state)])
    try:
        port_file = state / "alert-log.port"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the listener did not start"
            time.sleep(0.05)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        token = (state / "alert-log.token").read_text()
        url = f"http://127.0.0.1:{port_file.read_text()}/"
        ok = httpx.post(url, json={"text": "t"}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 204
        assert stat.S_IMODE(old_log.stat().st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(30)
