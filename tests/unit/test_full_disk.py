"""A full disk is not retried: the run fails at once, its reason naming the path (issue 35.7)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from prefect.states import Failed

from datagen.operations.failure import reason
from flows.expand_dataset import catalog_task, generate_shard_task, publish_task


def _enospc() -> OSError:
    """The kernel's own ENOSPC: /dev/full refuses every write (the error names no file)."""
    try:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b'{"request_key": "k"}\n')
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full for a real ENOSPC")
def test_a_full_disk_fails_the_retried_tasks_at_once_and_other_errors_are_retried(tmp_path: Path) -> None:
    # Issue 35.7: the generate task's retries waited 10 s + 60 s before the run failed the same way.
    full = _enospc()
    assert full.errno == errno.ENOSPC
    wrapped = RuntimeError("shard 3 failed")
    wrapped.__cause__ = full
    other = ConnectionError("server gone")
    for retried in (generate_shard_task, publish_task, catalog_task):
        assert retried.retries >= 1 and retried.retry_condition_fn is not None, retried.name
        # The state Prefect's task engine hands the condition for a raised exception (SyncTaskRunEngine.can_retry).
        for exc in (full, wrapped):
            assert retried.retry_condition_fn(retried, None, Failed(data=exc)) is False, (retried.name, exc)
        assert retried.retry_condition_fn(retried, None, Failed(data=other)) is True
        assert retried.retry_condition_fn(retried, None, Failed(message="crashed")) is True
    # What the failed run says: the path and what to do.
    assert f"writing under the work dir {tmp_path} (DATAGEN_WORK_DIR)" in reason(wrapped, tmp_path)
