"""A namespace's run lease against the real S3 server: one holder at a time, named to the others (issue 46)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from datagen.processes import start_ticks
from datagen.publishing.run_lease import LeaseHolder, NamespaceBusy, RunLease, local_lock
from datagen.publishing.storage import ObjectStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _lease(store: ObjectStore, owner: str, clock: Clock, state: str | None = "RUNNING") -> RunLease:
    return RunLease(
        store,
        "ns",
        owner,
        run_name=f"run-{owner}",
        flow="expand-dataset",
        lease_s=60,
        clock=clock,
        run_state=lambda _: state,
    )


def test_one_holder_at_a_time_and_the_refusal_names_it(s3_store: ObjectStore) -> None:
    clock = Clock()
    first = _lease(s3_store, "aaa", clock)
    first.acquire()
    with pytest.raises(NamespaceBusy) as refused:
        _lease(s3_store, "bbb", clock).acquire()
    assert "namespace ns is being run by flow run run-aaa (aaa) of expand-dataset" in str(refused.value)
    assert "having written nothing" in str(refused.value)
    # The holder's own retry (same flow run) takes it back; renewals move it on, nothing is ever replaced.
    _lease(s3_store, "aaa", clock).acquire()
    assert first.renew() is False and first.lost  # its next number was taken by its own retry above
    keys = [o.key for o in s3_store.list("_runs/ns/run-lease/")]
    assert [k.rsplit("/", 1)[1] for k in keys] == ["000001.json", "000002.json"]


def test_a_released_expired_or_finished_holder_frees_the_namespace(s3_store: ObjectStore) -> None:
    clock = Clock()
    with _lease(s3_store, "aaa", clock):
        pass  # released on exit
    holder = _lease(s3_store, "x", clock).holder()
    assert holder is not None and holder.released
    second = _lease(s3_store, "bbb", clock)
    second.acquire()
    clock.now += 61  # bbb stopped renewing: expired
    third = _lease(s3_store, "ccc", clock)
    third.acquire()
    assert not second.renew() and second.lost
    with pytest.raises(NamespaceBusy, match="lease lapsed and was taken by flow run run-ccc"):
        second.check()
    # A holder whose flow run Prefect reports over (crashed) frees it before its expiry.
    _lease(s3_store, "ddd", clock, state="CRASHED").acquire()


def test_a_holder_process_that_died_on_this_machine_frees_the_namespace(s3_store: ObjectStore) -> None:
    clock = Clock()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(child.stdout)
    lease = _lease(s3_store, "aaa", clock)
    holder = LeaseHolder(
        seq=1,
        owner="aaa",
        started_at=clock.now,
        expires_at=clock.now + 60,
        machine=lease.machine,
        pid=dead_pid,
        pid_start=12345,
    )
    s3_store.put_if_absent("_runs/ns/run-lease/000001.json", holder.model_dump_json().encode())
    _lease(s3_store, "bbb", clock).acquire()  # aaa's process is gone: taken
    # A live holder on this machine (this very process) is respected.
    live = LeaseHolder(
        seq=3,
        owner="ccc",
        started_at=clock.now,
        expires_at=clock.now + 60,
        machine=lease.machine,
        pid=os.getpid(),
        pid_start=start_ticks(os.getpid()),
    )
    s3_store.put_if_absent("_runs/ns/run-lease/000003.json", live.model_dump_json().encode())
    with pytest.raises(NamespaceBusy):
        _lease(s3_store, "ddd", clock).acquire()


def test_the_work_dir_lock_refuses_a_second_holder_on_the_box(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path)) / "runs" / "ns"
    code = (
        "import sys, time; from pathlib import Path; from datagen.publishing.run_lease import local_lock\n"
        "with local_lock(Path(sys.argv[1]), 'other run'):\n    print('held', flush=True); time.sleep(30)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == b"held"
        with (
            pytest.raises(NamespaceBusy, match=r"is in use by another run on this box .*other run"),
            local_lock(root, "me"),
        ):
            pass
    finally:
        other.kill()
        other.wait()
    with local_lock(root, "me"):  # free again once the holder is gone
        pass
