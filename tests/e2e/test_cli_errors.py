"""What the CLI says when a run fails: one line that names what to fix; the trace only with --verbose."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.failure import reason
from datagen.publishing.storage import StorageUnreachable

REPO_ROOT = Path(__file__).resolve().parents[2]


def _enospc() -> OSError:
    """A real ENOSPC from the kernel: /dev/full refuses every write, and the error names no file."""
    try:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"a checkpoint line\n")
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


def test_full_disk_names_the_work_dir_and_what_to_do(tmp_path: Path) -> None:
    exc = _enospc()
    assert exc.errno == errno.ENOSPC and exc.filename is None
    line = reason(RuntimeError("shard 3 failed"), tmp_path)
    assert line == "RuntimeError: shard 3 failed"
    wrapped = RuntimeError("shard 3 failed")
    wrapped.__cause__ = exc
    line = reason(wrapped, tmp_path / "work")
    assert f"writing under the work dir {tmp_path / 'work'} (DATAGEN_WORK_DIR)" in line
    assert "GB free of" in line and f"filesystem of {tmp_path}" in line
    assert "run again with the same namespace" in line and "\n" not in line
    named = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "shard-00003.completions.jsonl"))
    assert f"writing {tmp_path / 'shard-00003.completions.jsonl'}:" in reason(named, tmp_path)


def test_our_errors_are_their_own_message_on_one_line(tmp_path: Path) -> None:
    exc = StorageUnreachable("S3 endpoint http://127.0.0.1:9 is unreachable (EndpointConnectionError)\nduring put")
    assert reason(exc, tmp_path) == (
        "S3 endpoint http://127.0.0.1:9 is unreachable (EndpointConnectionError) during put"
    )


@pytest.mark.slow
def test_run_failing_on_s3_prints_one_line_not_a_traceback(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    config = tmp_path / "spec.json"
    spec = {"sources": [{"path": str(prompts)}], "model_path": str(ensure_model_dir()), "namespace": "clierr"}
    config.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(
        {
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
            # Port 9 (discard): nothing listens on loopback, so S3 is down for the whole run.
            "DATAGEN_S3_ENDPOINT_URL": "http://127.0.0.1:9",
            "DATAGEN_S3_ACCESS_KEY_ID": "id",
            "DATAGEN_S3_SECRET_ACCESS_KEY": "not-a-real-secret",
            "DATAGEN_ENGINE": "standin",
            "DATAGEN_SKIP_GPU_CHECKS": "true",
            "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
            "DATAGEN_WORK_DIR": str(tmp_path / "work"),
            # The prompt file sits in tmp_path: the box's roots must hold it (issue 20's path confinement).
            "DATAGEN_DATA_ROOTS": str(tmp_path),
        }
    )
    argv = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    quiet = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 1, quiet.stderr[-3000:]
    lines = quiet.stderr.strip().splitlines()
    failed = [i for i, line in enumerate(lines) if line.startswith("datagen: run failed:")]
    assert len(failed) == 1, lines[-20:]
    last = lines[failed[0] : failed[0] + 2]
    assert "Traceback" not in "\n".join(lines[failed[0] :])  # nothing after it but Prefect's own shutdown line
    # One line: how many checks failed, then each failed check and its detail.
    assert last[0].startswith("datagen: run failed: 1 of "), last
    assert " environment checks failed: s3.credentials: S3 endpoint " in last[0], last
    assert "http://127.0.0.1:9 is unreachable" in last[0]
    assert last[1] == "datagen: the full trace is in the flow's log above; `datagen run --verbose` raises it"
    assert "not-a-real-secret" not in quiet.stderr + quiet.stdout

    verbose = subprocess.run([*argv, "--verbose"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert verbose.returncode == 1
    assert "tasks.environment.EnvironmentCheckFailed: 1 of " in verbose.stderr
