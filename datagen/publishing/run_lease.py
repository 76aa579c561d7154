"""One run at a time per namespace: a lease in S3 the run holds while it works, and a lock on its work dir.

Two runs of one namespace at once (a scheduled expansion that overruns into the next night's, a manual run beside
the schedule, the same spec started on two boxes) would write the same checkpoints and publish into the same
namespace. Each run therefore holds the namespace's lease for as long as it works:

    _runs/<namespace>/run-lease/000001.json   {"owner": <flow run id>, "run_name", "flow", "host", "expires_at", ...}

A lease is the highest-numbered object. Taking or renewing it creates the next number with a conditional put
(If-None-Match), so of two runs racing for the same number exactly one wins and nothing is ever replaced; the run
renews it every `lease_s / 4` from a thread and writes a released one when it ends. Another run that finds it
held (not released, not expired, its process alive if it ran on this machine, its flow run not over) is refused
with the holder named, before it has written anything. The owner is the Prefect flow run id, so a retry of the
same flow run takes its own lease back; a run that died leaves a lease that its expiry (or its flow run's terminal
state, when Prefect says so) frees.
Expiry is compared against each host's own clock: keep the boxes on NTP.

On the run's box, a lock on `<work dir>/runs/<namespace>/run.lock` (flock) guards the local checkpoints too, for
runs that write nothing to S3 (dry runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

from datagen.processes import is_process, machine_id, start_ticks
from datagen.publishing.storage import ObjectExists, ObjectStore

__all__ = ["RUNS_PREFIX", "LeaseHolder", "NamespaceBusy", "RunLease", "local_lock"]

logger = logging.getLogger(__name__)

# Run state in S3 (this lease, a multi-box run's shards and claims) lives under this prefix of the bucket's prefix.
RUNS_PREFIX = "_runs"
_TERMINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})


class NamespaceBusy(RuntimeError):
    """Another run holds the namespace: this run is refused before it writes anything."""


class LeaseHolder(BaseModel):
    """One lease object: which run holds the namespace until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(..., ge=1)
    owner: str = Field(..., description="The holding run's Prefect flow run id (a random token outside Prefect).")
    run_name: str = ""
    flow: str = ""
    host: str = ""
    started_at: float = Field(..., description="Unix time the holder first took the lease.")
    expires_at: float = Field(..., description="Unix time the lease ends unless renewed (the holder's clock).")
    released: bool = False
    machine: str = Field("", description="The holder's machine (`datagen.processes.machine_id`).")
    pid: int = 0
    pid_start: int | None = Field(None, description="The holder's process start time (a reused pid is another).")

    def describe(self) -> str:
        """The holder in words, for a refusal."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        until = time.strftime("%H:%M:%S UTC", time.gmtime(self.expires_at))
        return (
            f"flow run {self.run_name or '?'} ({self.owner}) of {self.flow or '?'} on host {self.host or '?'}, "
            f"since {when} (its lease runs to {until} unless renewed)"
        )


def _run_state(run_id: str) -> str | None:
    """The Prefect state type of flow run `run_id`, or None when Prefect cannot say (no server, not a run id)."""
    try:
        from uuid import UUID

        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state
        return state.type.value if state else None
    except Exception:
        return None


class RunLease:
    """This run's hold on a namespace in S3 (`with RunLease(...):`, or `acquire()` / `release()`)."""

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        owner: str,
        *,
        run_name: str = "",
        flow: str = "",
        lease_s: float = 180.0,
        clock: Callable[[], float] = time.time,
        run_state: Callable[[str], str | None] = _run_state,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.store = store
        self.namespace = namespace
        self.owner = owner
        self.run_name = run_name
        self.flow = flow
        self.host = socket.gethostname()
        self.machine = machine_id(self.host)
        self.lease_s = lease_s
        self.clock = clock
        self.run_state = run_state
        self.prefix = f"{RUNS_PREFIX}/{namespace}/run-lease/"
        self.seq = 0
        self.started_at = 0.0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> LeaseHolder | None:
        """The namespace's latest lease object, or None when no run ever held it."""
        keys = sorted(o.key for o in self.store.list(self.prefix))
        return LeaseHolder.model_validate_json(self.store.get_bytes(keys[-1])) if keys else None

    def _held_by_another(self, latest: LeaseHolder) -> bool:
        if latest.owner == self.owner or latest.released or latest.expires_at <= self.clock():
            return False
        if latest.machine == self.machine and latest.pid and not is_process(latest.pid, latest.pid_start):
            # Held from this machine by a process that is gone (killed): nothing renews it any more.
            logger.warning(
                "namespace %s: the lease of run %s is left by a process that died: taken", self.namespace, latest.owner
            )
            return False
        state = self.run_state(latest.owner)
        if state in _TERMINAL:  # the holder's flow run is over: its lease is left over
            logger.warning(
                "namespace %s: the lease of run %s is left over (%s): taken", self.namespace, latest.owner, state
            )
            return False
        return True

    def _write(self, seq: int, *, released: bool = False) -> bool:
        now = self.clock()
        holder = LeaseHolder(
            seq=seq,
            owner=self.owner,
            run_name=self.run_name,
            flow=self.flow,
            host=self.host,
            started_at=self.started_at or now,
            expires_at=now if released else now + self.lease_s,
            released=released,
            machine=self.machine,
            pid=os.getpid(),
            pid_start=start_ticks(os.getpid()),
        )
        try:
            self.store.put_if_absent(f"{self.prefix}{seq:06d}.json", holder.model_dump_json().encode())
        except ObjectExists:
            return False
        self.seq = seq
        return True

    def acquire(self) -> None:
        """Take the namespace, or raise NamespaceBusy naming the run that holds it."""
        for _ in range(3):  # a lost race re-reads: the winner may have released already
            latest = self.holder()
            if latest is not None and self._held_by_another(latest):
                raise NamespaceBusy(
                    f"namespace {self.namespace} is being run by {latest.describe()}; two runs of one namespace would "
                    "write the same checkpoints and objects, so this run stops here, having written nothing. Start it "
                    "again once that run has ended (or cancel that run)."
                )
            self.started_at = self.clock()
            if self._write(latest.seq + 1 if latest else 1):
                return
        raise NamespaceBusy(f"namespace {self.namespace}: lost the race for its lease three times; start the run again")

    def renew(self) -> bool:
        """Extend the lease with the next number; False (and `lost`) when another run took the namespace."""
        if self.lost or self._write(self.seq + 1):
            return not self.lost
        self.lost = True
        logger.error("namespace %s: the run lease was taken by another run; this run will not publish", self.namespace)
        return False

    def check(self) -> None:
        """Raise NamespaceBusy when the lease was lost (another run took the namespace while this one stalled)."""
        if self.lost:
            holder = self.holder()
            raise NamespaceBusy(
                f"namespace {self.namespace}: this run's lease lapsed and was taken by "
                f"{holder.describe() if holder else 'another run'}; nothing more is written"
            )

    def release(self) -> None:
        """Stop renewing and mark the lease released (the next run needs not wait for its expiry)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.lost and self.seq:
            with contextlib.suppress(Exception):  # a release that fails leaves a lease that expires
                self._write(self.seq + 1, released=True)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                if not self.renew():
                    return
            except Exception:  # S3 unreachable for a moment: the next round tries again, within the lease
                logger.warning("namespace %s: renewing the run lease failed", self.namespace, exc_info=True)

    def __enter__(self) -> RunLease:
        self.acquire()
        self._thread = threading.Thread(target=self._renew_loop, name=f"run-lease-{self.namespace}", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@contextlib.contextmanager
def local_lock(root: Path, describe: str) -> Iterator[None]:
    """Hold `root/run.lock` (flock) for the block; NamespaceBusy naming the holder when another process has it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "run.lock"
    handle: IO[str] = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise NamespaceBusy(
                f"{root} is in use by another run on this box ({handle.read().strip() or 'unknown'}); start this run "
                "again once that one has ended"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "run": describe}))
        handle.flush()
        yield
    finally:
        handle.close()
